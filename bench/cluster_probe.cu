/*
 * cluster_probe.cu - where the blocks of one context's attention grid would
 * land if each kv head's spans formed one thread-block cluster (so that the
 * spans' partials merge through distributed shared memory instead of a
 * second kernel): for cluster sizes 8 to 16 and one or two blocks per SM,
 * the runtime's bound (cudaOccupancyMaxActiveClusters) and what a launch of
 * 8 clusters (one context, 8 kv heads) does: how many SMs its blocks use, the
 * most blocks on one SM, and whether every cluster ran at once (the latest
 * block start against the earliest block end).
 *
 * A diagnostic, not part of the library: the blocks only spin (~40 us) and
 * record their SM (%smid) and the global timer. Occupancy is set by dynamic
 * shared memory (one block per SM: 150 KiB; two: 100 KiB), 256 threads each.
 *
 * Built with the project as akv_cluster_probe (the GPU pass's bench step runs
 * it with the other programs in bench/), or alone:
 *   nvcc -O2 -arch=sm_90 -o cluster_probe bench/cluster_probe.cu
 * usage: akv_cluster_probe          (prints one JSON line per configuration)
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

struct Rec {
  unsigned smid;
  unsigned long long start, end;
};

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void probe(Rec *out, unsigned long long spin_ns) {
  extern __shared__ unsigned char smem[];
  const unsigned long long t0 = now_ns();
  if (threadIdx.x == 0) smem[0] = 1; /* the allocation is what matters */
  while (now_ns() - t0 < spin_ns) {
  }
  if (threadIdx.x == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    Rec r;
    r.smid = smid;
    r.start = t0;
    r.end = now_ns();
    out[blockIdx.x] = r;
  }
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 150 * 1024));
  Rec *d = nullptr;
  const int heads = 8;
  CK(cudaMalloc(&d, sizeof(Rec) * heads * 16));
  for (int per_sm = 1; per_sm <= 2; ++per_sm) {
    const size_t smem = per_sm == 1 ? 150 * 1024 : 100 * 1024;
    for (int cs : {8, 10, 12, 13, 14, 15, 16}) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = cs;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(heads * cs);
      cfg.blockDim = dim3(256);
      cfg.dynamicSmemBytes = smem;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int max_clusters = 0;
      CK(cudaOccupancyMaxActiveClusters(&max_clusters, probe, &cfg));
      if (max_clusters == 0) { /* the cluster does not fit a GPC at this occupancy */
        printf("{\"bench\":\"cluster_probe\",\"blocks_per_sm\":%d,\"cluster\":%d,\"sms\":%d,"
               "\"max_active_clusters\":0}\n",
               per_sm, cs, sms);
        continue;
      }
      CK(cudaMemset(d, 0, sizeof(Rec) * heads * 16));
      CK(cudaLaunchKernelEx(&cfg, probe, d, 40000ull));
      CK(cudaDeviceSynchronize());
      std::vector<Rec> h(heads * cs);
      CK(cudaMemcpy(h.data(), d, sizeof(Rec) * h.size(), cudaMemcpyDeviceToHost));
      std::vector<int> per(sms + 1, 0);
      unsigned long long first_end = ~0ull, last_start = 0;
      for (const Rec &r : h) {
        if (r.smid < (unsigned)sms) per[r.smid]++;
        first_end = std::min(first_end, r.end);
        last_start = std::max(last_start, r.start);
      }
      int used = 0, most = 0;
      for (int s = 0; s < sms; ++s) {
        used += per[s] > 0;
        most = std::max(most, per[s]);
      }
      printf("{\"bench\":\"cluster_probe\",\"blocks_per_sm\":%d,\"cluster\":%d,\"sms\":%d,"
             "\"max_active_clusters\":%d,\"blocks\":%d,\"sms_used\":%d,\"most_blocks_on_one_sm\":%d,"
             "\"one_wave\":%s}\n",
             per_sm, cs, sms, max_clusters, heads * cs, used, most,
             last_start < first_end ? "true" : "false");
    }
  }
  CK(cudaFree(d));
  return 0;
}
