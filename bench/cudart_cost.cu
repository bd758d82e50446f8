/*
 * cudart_cost.cu - host time of the CUDA runtime calls the engine's enqueue
 * path is made of, measured one call at a time on the calling thread.
 *
 * This is the floor under bench/host_cost.c: the engine's host cost per layer
 * is roughly the sum of the calls it issues plus its own bookkeeping. Each
 * figure is the median (and p90) of `reps` calls; the queue is drained every
 * 32 calls outside the timed region so no call meets a full queue.
 *
 * Also checks (not timed) that a kernel can write rows into pinned host
 * memory through its host pointer (unified addressing), the write-back form
 * that replaces a D2H copy call by a kernel launch.
 *
 * usage: akv_cudart_cost [reps]
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#define CK(call)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                \
              cudaGetErrorString(e_));                                             \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

static double now_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e6 * (double)ts.tv_sec + 1e-3 * (double)ts.tv_nsec;
}

struct Rows8 {
  const uint4 *src[8];
  uint4 *dst[8];
  uint32_t words;
};

__global__ void rows_kernel(const __grid_constant__ Rows8 r) {
  const uint32_t d = blockIdx.x;
  for (uint32_t w = threadIdx.x; w < r.words; w += blockDim.x) r.dst[d][w] = r.src[d][w];
}

__global__ void empty_kernel() {}

/* Parameter blocks of the engine's device->device gather (backend_cuda.cu:
 * 20 bytes per descriptor, up to 1024 per launch): what a launch costs the
 * host as its parameters grow. */
template <int N>
struct GatherParams {
  const uint4 *src[N];
  uint4 *dst[N];
  uint32_t words[N];
};
template <int N>
__global__ void gather_params_kernel(const __grid_constant__ GatherParams<N> b) {
  if (threadIdx.x == 0 && b.words[blockIdx.x] == 0xffffffffu) b.dst[0][0] = b.src[0][0];
}

template <class F>
static void measure(const char *name, int reps, cudaStream_t drain, F &&f) {
  std::vector<double> t;
  t.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    if (i % 32 == 0) CK(cudaDeviceSynchronize());
    double a = now_us();
    f();
    t.push_back(now_us() - a);
  }
  CK(cudaDeviceSynchronize());
  (void)drain;
  std::sort(t.begin(), t.end());
  printf("%-44s median %6.2f us  p90 %6.2f us\n", name, t[t.size() / 2], t[t.size() * 9 / 10]);
  printf("{\"bench\":\"cudart_cost\",\"call\":\"%s\",\"median_us\":%.3f,\"p90_us\":%.3f,"
         "\"reps\":%d}\n",
         name, t[t.size() / 2], t[t.size() * 9 / 10], reps);
}

int main(int argc, char **argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 4000;
  const size_t row = 2048, rows_h2d = 16;
  cudaStream_t s1, s2;
  cudaEvent_t ev;
  uint8_t *host = nullptr, *dev = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaHostAlloc((void **)&host, 8 << 20, cudaHostAllocDefault));
  CK(cudaMalloc((void **)&dev, 8 << 20));
  memset(host, 0, 8 << 20);

  void *dst[8];
  const void *src[8];
  size_t bytes[8];
  cudaMemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t idx = 0;

  measure("cudaEventRecord", reps, s1, [&] { CK(cudaEventRecord(ev, s1)); });
  measure("cudaStreamWaitEvent", reps, s1,
          [&] { CK(cudaStreamWaitEvent(s2, ev, cudaEventWaitDefault)); });
  measure("cudaEventQuery (complete)", reps, s1, [&] { (void)cudaEventQuery(ev); });
  for (int n : {1, 4, 8}) {
    for (int i = 0; i < 8; ++i) {
      dst[i] = dev + (size_t)i * (1 << 20);
      src[i] = host + (size_t)i * (1 << 20);
      bytes[i] = rows_h2d * row;
    }
    attr.srcLocHint.type = cudaMemLocationTypeHost;
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    char name[64];
    snprintf(name, sizeof name, "cudaMemcpyBatchAsync H2D x%d (32 KiB each)", n);
    measure(name, reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, n, &attr, &idx, 1, s1)); });
    for (int i = 0; i < 8; ++i) {
      dst[i] = host + (size_t)i * (1 << 20);
      src[i] = dev + (size_t)i * (1 << 20);
      bytes[i] = row;
    }
    attr.srcLocHint.type = cudaMemLocationTypeDevice;
    attr.dstLocHint.type = cudaMemLocationTypeHost;
    snprintf(name, sizeof name, "cudaMemcpyBatchAsync D2H x%d (2 KiB each)", n);
    measure(name, reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, n, &attr, &idx, 1, s1)); });
  }
  /* The engine's write-back shape (4 rows) under other attributes. */
  for (int i = 0; i < 4; ++i) {
    dst[i] = host + (size_t)i * (1 << 20);
    src[i] = dev + (size_t)i * (1 << 20);
    bytes[i] = 2 * row;
  }
  {
    cudaMemcpyAttributes a2;
    memset(&a2, 0, sizeof a2);
    a2.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    measure("batch D2H x4: no hints, no flags", reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, 4, &a2, &idx, 1, s1)); });
    a2.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    measure("batch D2H x4: no hints, overlap flag", reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, 4, &a2, &idx, 1, s1)); });
    a2.flags = 0;
    a2.srcLocHint.type = cudaMemLocationTypeDevice;
    a2.dstLocHint.type = cudaMemLocationTypeHost;
    measure("batch D2H x4: hints, no flags", reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, 4, &a2, &idx, 1, s1)); });
    a2.srcAccessOrder = cudaMemcpySrcAccessOrderAny;
    measure("batch D2H x4: hints, access order any", reps, s1,
            [&] { CK(cudaMemcpyBatchAsync(dst, src, bytes, 4, &a2, &idx, 1, s1)); });
  }
  measure("cudaMemcpyAsync D2H (2 KiB)", reps, s1, [&] {
    CK(cudaMemcpyAsync(host, dev, row, cudaMemcpyDeviceToHost, s1));
  });
  measure("cudaMemcpyAsync H2D (32 KiB)", reps, s1, [&] {
    CK(cudaMemcpyAsync(dev, host, rows_h2d * row, cudaMemcpyHostToDevice, s1));
  });
  measure("empty kernel launch", reps, s1, [&] {
    empty_kernel<<<1, 32, 0, s1>>>();
    CK(cudaGetLastError());
  });
  {
    static GatherParams<64> g64;
    static GatherParams<256> g256;
    static GatherParams<1024> g1024;
    measure("kernel launch, 1.3 KB params (64 descriptors)", reps, s1, [&] {
      gather_params_kernel<64><<<64, 32, 0, s1>>>(g64);
      CK(cudaGetLastError());
    });
    measure("kernel launch, 5 KB params (256 descriptors)", reps, s1, [&] {
      gather_params_kernel<256><<<256, 32, 0, s1>>>(g256);
      CK(cudaGetLastError());
    });
    measure("kernel launch, 20 KB params (1024 descriptors)", reps, s1, [&] {
      gather_params_kernel<1024><<<512, 32, 0, s1>>>(g1024);
      CK(cudaGetLastError());
    });
  }
  Rows8 r;
  for (int i = 0; i < 8; ++i) {
    r.src[i] = (const uint4 *)(dev + (size_t)i * (1 << 20));
    r.dst[i] = (uint4 *)(host + (size_t)i * (1 << 20) + 4096);
  }
  r.words = (uint32_t)(row / 16);
  measure("row kernel launch (8 rows -> pinned host)", reps, s1, [&] {
    rows_kernel<<<8, 128, 0, s1>>>(r);
    CK(cudaGetLastError());
  });

  /* Correctness of the kernel form: device rows land in pinned host memory. */
  {
    std::vector<uint8_t> pattern(8 * row);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = (uint8_t)(i * 131 + 7);
    for (int i = 0; i < 8; ++i)
      CK(cudaMemcpy(dev + (size_t)i * (1 << 20), pattern.data() + i * row, row,
                    cudaMemcpyHostToDevice));
    rows_kernel<<<8, 128, 0, s1>>>(r);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s1));
    int bad = 0;
    for (int i = 0; i < 8; ++i)
      bad += memcmp(host + (size_t)i * (1 << 20) + 4096, pattern.data() + i * row, row) != 0;
    printf("row kernel into pinned host memory: %s\n", bad ? "MISMATCH" : "bit-identical");
    if (bad) return 1;
  }
  CK(cudaFreeHost(host));
  CK(cudaFree(dev));
  return 0;
}
