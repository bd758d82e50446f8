/*
 * activekv.c - the ActiveKV command line: a synthetic transformer of a real
 * geometry decoding several long contexts through libactivekv.
 *
 *   activekv [demo]    a small model (CUDA if a GPU is there, else host): routes
 *                      stage, arena and paged, then paged on a hybrid geometry,
 *                      each checked bit for bit against resident attention
 *   activekv decode    one route, timed; --check compares every step's logits
 *                      with resident attention in the same process
 *   activekv fit       the host-fit line (akv_fit) and its verdict
 *
 * Routes: resident (the model keeps every row on the device; the reference),
 * stage (every row crosses PCIe each step), arena (rows retained in the device
 * page pool are copied device to device, the rest staged), paged (attention
 * reads the retained pages in place through the step's page map). Staged
 * routes run the engine's per-layer lease cycle of akv.h: begin layer l,
 * retire without blocking (akv_lease_try_retire) every earlier layer up to
 * l-2 whose fences have passed, attend through the hook (which writes the
 * step's new K/V row at len[i] and enqueues attention over len[i]+1 rows),
 * write back, seal; after the last layer, retire the rest (blocking).
 *
 * Hybrid geometries (--window, --dense-every, preset gemma3-12b): only the
 * dense layers are the engine's (its layer d is the model's d-th dense
 * layer); sliding-window layers attend over rows the model keeps itself, one
 * set per run, so a checked route and its resident reference never share them.
 *
 * Exit status: 0 success, 1 runtime error, 2 bad usage, 3 `fit` found no fit,
 * 4 --check found a mismatch.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sys/stat.h>

#include "akv.h"
#include "akv_group.h"
#include "model.h"
#ifdef ACTIVEKV_NCCL
#include "tp_nccl.h"
#endif

enum { EXIT_RUN_ERROR = 1, EXIT_USAGE = 2, EXIT_NO_FIT = 3, EXIT_MISMATCH = 4 };

#define GIB ((uint64_t)1 << 30)
#define MAX_LIST 16
#define TP_MAX 16 /* most ranks of --tp */
/* --tp: the group's agreement timeout; a CUDA run that lost a rank gives
 * the others this long and a margin to end (run_tp) */
#define TP_GROUP_TIMEOUT_MS 120000u
#define TP_GRACE_S (TP_GROUP_TIMEOUT_MS / 1000u + 30u)

/* ------------------------------------------------------------------------ */
/* Options                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum cli_route {
  ROUTE_RESIDENT = 0,
  ROUTE_STAGE = 1,
  ROUTE_ARENA = 2,
  ROUTE_PAGED = 3
} cli_route;

static const char *const route_names[] = {"resident", "stage", "arena", "paged"};

/* Routes that keep pages in the device pool. */
static int route_retains(cli_route r) { return r == ROUTE_ARENA || r == ROUTE_PAGED; }

typedef struct preset {
  const char *name;
  model_geometry g;
} preset;

/* n_layers, n_heads, kv_heads, head_dim, hidden, ffn, vocab, rope_theta, norm_eps,
 * window, dense_every. gemma3-12b is a hybrid geometry: a 1024-token sliding
 * window on five of every six layers, so 8 of its 48 layers are dense and
 * staged (its blocks are this model's: SwiGLU MLP, one RoPE base). */
static const preset presets[] = {
    {"llama3-8b", {32, 32, 8, 128, 4096, 14336, 128256, 500000.0f, 1e-5f, 0, 0}},
    {"llama3.2-1b", {16, 32, 8, 64, 2048, 8192, 128256, 500000.0f, 1e-5f, 0, 0}},
    {"gemma3-12b", {48, 16, 8, 256, 3840, 15360, 262208, 1000000.0f, 1e-6f, 1024, 6}},
    {"tiny", {4, 4, 2, 16, 64, 128, 256, 10000.0f, 1e-5f, 0, 0}},
};

typedef struct cli_opts {
  const char *preset;
  int preset_set;       /* --preset was given */
  /* Given on the command line, for flags whose default is not 0: a flag the
   * run would not act on is refused by name. */
  int seed_set, delay_seed_set, pcie_set;
  int preset_defaulted; /* no --preset, host backend: tiny instead of llama3.2-1b */
  model_geometry g;
  uint64_t seed;
  uint32_t contexts;
  uint32_t tokens[MAX_LIST]; /* prefilled rows; context i takes tokens[i % n_tokens] */
  uint32_t n_tokens;
  uint32_t steps, warmup;
  cli_route route;
  akv_backend_kind backend;
  int device;
  uint32_t host_pool_gib; /* 0: the smallest that fits --contexts */
  uint32_t device_pool_gib;
  uint32_t headroom_gib, headroom_reserve_gib; /* revocable headroom (0: off) */
  uint32_t host_device_mib; /* host backend testing aid: a modelled device of N MiB; 0: none */
  uint32_t release_headroom_at; /* 1-based step whose middle gives all headroom back; 0: never */
  uint32_t page_tokens;
  uint32_t chunk_tokens; /* 0: --page-tokens */
  uint32_t target_pages, burst_pages;
  akv_fit_mode fit_mode;
  uint64_t delay_seed;   /* host backend testing aid: injected queue delays */
  uint32_t delay_max_us;
  uint32_t fail_nth;     /* testing aid: fail the N-th backend operation */
  int check, json, verbose, progress;
  double pcie_gbps;
  akv_dtype kv_dtype;      /* --kv-dtype: bf16 or FP8 E4M3 rows */
  const char *logits_out;  /* --logits-out: every step's logits, raw fp32 */
  const char *logits_ref;  /* --logits-ref: compare with (and follow) such a file */
  uint32_t tp;             /* --tp N: ranks (0: not given, a plain run) */
  /* Set on a rank's copy of the options in a --tp run: g is the rank's
   * shard (heads, kv heads, ffn divided by tp), full_g the whole model. */
  uint32_t tp_rank;
  model_geometry full_g;
} cli_opts;

static const preset *find_preset(const char *name);
static akv_backend_kind resolve_backend(const cli_opts *o);

static void opts_default(cli_opts *o) {
  memset(o, 0, sizeof *o);
  o->preset = "llama3.2-1b";
  o->g = find_preset("llama3.2-1b")->g;
  o->seed = 1;
  o->contexts = 4;
  o->tokens[0] = 4096;
  o->n_tokens = 1;
  o->steps = 16;
  o->warmup = 2;
  o->route = ROUTE_STAGE;
  o->backend = AKV_BACKEND_AUTO;
  o->page_tokens = 256;
  o->target_pages = AKV_TARGET_FAIR_SHARE;
  o->fit_mode = AKV_FIT_REFUSE;
  o->pcie_gbps = 55.4;
  o->progress = 1;
  o->delay_seed = 1;
}

static uint32_t ctx_tokens(const cli_opts *o, uint32_t i) { return o->tokens[i % o->n_tokens]; }

static uint32_t max_history(const cli_opts *o) {
  uint32_t m = 0;
  for (uint32_t i = 0; i < o->contexts; ++i)
    if (ctx_tokens(o, i) > m) m = ctx_tokens(o, i);
  return m;
}

/* Rows a context may hold: its history plus one per decoded step. */
static uint32_t max_tokens(const cli_opts *o) { return max_history(o) + o->warmup + o->steps; }

static uint32_t chunk_tokens(const cli_opts *o) {
  return o->chunk_tokens ? o->chunk_tokens : o->page_tokens;
}

/* ------------------------------------------------------------------------ */
/* Messages                                                                  */
/* ------------------------------------------------------------------------ */

/* The library's last warning or error logged on this thread, quoted in our
 * errors. One per thread: with --tp every rank's thread logs and quotes at
 * once, and a process-wide buffer was written by one rank (under
 * lib_log_mu) while another read it unlocked into its message (a data
 * race), which could quote another rank's line. The calls whose failures
 * are quoted (create, destroy) log on the calling thread. */
static _Thread_local char lib_last[512];
/* Set when a warning or error logged on this thread reported a fault that
 * --fail-nth injected (a --tp rank's create quotes the group's line, which
 * does not say so); cleared before the calls whose failures it explains. */
static _Thread_local int lib_injected;
static int lib_verbose;

static void say_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  /* One line, whole: with --tp rank threads report at once, and three
   * separate writes interleaved ("activekv: activekv: ..."). */
  flockfile(stderr);
  fputs("activekv: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  funlockfile(stderr);
  va_end(ap);
}

static pthread_mutex_t lib_log_mu = PTHREAD_MUTEX_INITIALIZER; /* --tp: ranks log at once */
static void lib_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  pthread_mutex_lock(&lib_log_mu);
  if (level <= AKV_LOG_WARN) {
    snprintf(lib_last, sizeof lib_last, "%s", message);
    if (strstr(message, "injected fault") != NULL) lib_injected = 1;
  }
  if (level <= AKV_LOG_WARN || lib_verbose) {
    static const char *const names[] = {"error", "warn", "info", "debug"};
    fprintf(stderr, "activekv: libactivekv %s: %s\n", names[level <= AKV_LOG_DEBUG ? level : 3],
            message);
  }
  pthread_mutex_unlock(&lib_log_mu);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Binary units for memory ("15.5 GiB"). */
static const char *fmt_mem(char *buf, size_t cap, uint64_t bytes) {
  static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int i = 0;
  while (v >= 1024.0 && i < 4) {
    v /= 1024.0;
    ++i;
  }
  snprintf(buf, cap, i == 0 ? "%.0f %s" : "%.2f %s", v, u[i]);
  return buf;
}

/* Decimal units for transfers, to sit beside GB/s ("16.6 GB"). */
static const char *fmt_xfer(char *buf, size_t cap, double bytes) {
  static const char *const u[] = {"B", "kB", "MB", "GB", "TB"};
  int i = 0;
  while (bytes >= 1000.0 && i < 4) {
    bytes /= 1000.0;
    ++i;
  }
  snprintf(buf, cap, i == 0 ? "%.0f %s" : "%.2f %s", bytes, u[i]);
  return buf;
}

/* Parameter counts, always decimal: "1.50 B", "268.44 M". */
static const char *fmt_params(char *buf, size_t cap, uint64_t params) {
  const double p = (double)params;
  if (p >= 1e9) snprintf(buf, cap, "%.2f B", p / 1e9);
  else snprintf(buf, cap, "%.2f M", p / 1e6);
  return buf;
}

/* Physical memory of this machine in bytes, or 0 when it cannot be read. */
static uint64_t machine_memory_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return (uint64_t)pages * (uint64_t)page;
}

/* A progress bar on stderr, drawn only when stderr is a terminal. */
typedef struct progress {
  int on;
  const char *what;
  uint64_t total;
  double start, last;
} progress;

static void progress_begin(progress *p, int enabled, const char *what, uint64_t total) {
  p->on = enabled && isatty(STDERR_FILENO);
  p->what = what;
  p->total = total ? total : 1;
  p->start = p->last = now_s();
}

static void progress_update(progress *p, uint64_t done, const char *unit_rate) {
  if (!p->on) return;
  double t = now_s();
  if (done < p->total && t - p->last < 0.1) return;
  p->last = t;
  const int width = 32;
  int fill = (int)(width * (double)done / (double)p->total);
  char bar[40];
  for (int i = 0; i < width; ++i) bar[i] = i < fill ? '#' : '.';
  bar[width] = '\0';
  fprintf(stderr, "\r%s [%s] %3d%%  %s", p->what, bar, (int)(100.0 * done / p->total),
          unit_rate ? unit_rate : "");
  if (done >= p->total) fputc('\n', stderr);
  fflush(stderr);
}

/* ------------------------------------------------------------------------ */
/* Argument parsing                                                          */
/* ------------------------------------------------------------------------ */

static void usage(FILE *f) {
  fprintf(f,
          "usage: activekv [demo|decode|fit] [options]\n"
          "\n"
          "  demo     (default) a small model, CUDA if a GPU is there, else host: routes\n"
          "           stage, arena and paged, then paged on a hybrid geometry, each\n"
          "           checked bit for bit against resident\n"
          "  decode   decode a synthetic model on one route and report tokens/s\n"
          "  fit      print the host-fit line and its verdict (exit 3 if it does not fit);\n"
          "           refuses --check, --tp, --logits-out, --logits-ref,\n"
          "           --release-headroom-at, --seed, --pcie-gbps, --target-pages,\n"
          "           --burst-pages and the testing aids, which only decode acts on\n"
          "\n"
          "model (flags override the preset's values):\n"
          "  --preset NAME         llama3-8b | llama3.2-1b | gemma3-12b | tiny\n"
          "                        [llama3.2-1b on CUDA; tiny on the host backend]\n"
          "  --layers N            layers (dense and sliding-window)\n"
          "  --heads N             query heads\n"
          "  --kv-heads N          K/V heads (GQA)\n"
          "  --head-dim N          multiple of 8, at most 256 (CUDA: 64, 128 or 256)\n"
          "  --hidden N  --ffn N  --vocab N  --rope-theta F\n"
          "  --window N            hybrid: sliding-window layers attend over the last N\n"
          "                        tokens, kept resident by the model (never staged);\n"
          "                        0 makes every layer dense   [preset's]\n"
          "  --dense-every N       hybrid: every N-th layer is dense, the rest slide\n"
          "                        [preset's; 6 with --window on a dense preset]\n"
          "  --seed N              weights, history and first tokens   [1]\n"
          "workload:\n"
          "  --contexts N          contexts decoded together, 1..%d   [4]\n"
          "  --tokens N[,N...]     prefilled rows per context; a list is taken in turn, at\n"
          "                        most --contexts values   [4096]\n"
          "                        (a context holds --tokens + --warmup + --steps rows)\n"
          "  --steps N             measured decode steps   [16]\n"
          "  --warmup N            decode steps before measuring   [2]\n"
          "engine:\n"
          "  --route R             resident | stage | arena | paged   [stage]\n"
          "  --backend B           auto | host | cuda   [auto]\n"
          "  --device N            CUDA device   [0]\n"
          "  --host-pool-gib N     pinned host pool   [the smallest that fits --contexts]\n"
          "  --device-pool-gib N   device page pool (arena, paged); at 0 nothing is retained\n"
          "                        and every row is staged, as on stage (said on stderr),\n"
          "                        unless --headroom-gib retains it   [0]\n"
          "  --headroom-gib N      revocable headroom: borrow up to N GiB of free device memory\n"
          "                        for history (arena, paged); 0 = off   [0]\n"
          "  --headroom-reserve-gib N  device memory headroom leaves free   [0]\n"
          "  --release-headroom-at STEP  give all headroom back in the middle of step STEP\n"
          "                        (1..--warmup + --steps: warm-up included) and time it\n"
          "                        [never]\n"
          "  --host-device-mib N   host backend, testing: model a device of N MiB so that\n"
          "                        headroom has free memory to take   [0: none free]\n"
          "  --page-tokens N       tokens per device page   [256]\n"
          "  --chunk-tokens N      attention chunk   [--page-tokens]\n"
          "  --kv-dtype T          bf16 | fp8: K/V rows in bf16, or FP8 E4M3 quantized on\n"
          "                        write with fixed per-head scales (half the bytes)   [bf16]\n"
          "  --target-pages N      device pages each context holds by right   [fair share]\n"
          "  --burst-pages N       pages each context may borrow while free   [0]\n"
          "  --fit-mode M          refuse | shrink   [refuse]\n"
          "  --host-delay-us N     host backend test aid: random delays up to N us on every\n"
          "                        queue operation (schedule perturbation)   [0]\n"
          "  --host-delay-seed N   seed of those delays   [1]\n"
          "  --fail-nth N          test aid: the engine fails its N-th backend operation\n"
          "tensor parallel (decode):\n"
          "  --tp N                shard the model Megatron-style over N ranks, one thread\n"
          "                        and one engine each, bound into one group (host backend:\n"
          "                        in-process agreement; CUDA: rank r on GPU r, agreement\n"
          "                        and all-reduce through NCCL); kv heads and heads must\n"
          "                        divide by N\n"
          "output:\n"
          "  --check               also decode resident in this process and compare the\n"
          "                        logits of every step bit for bit (exit 4 on a mismatch)\n"
          "  --json                one JSON object on stdout instead of the report\n"
          "  --pcie-gbps F         host-to-device rate of the PCIe bound   [55.4]\n"
          "  --logits-out FILE     write every step's logits (warm-up included), fp32\n"
          "                        [steps][contexts][vocab], raw\n"
          "  --logits-ref FILE     such a file from another run (e.g. --kv-dtype bf16):\n"
          "                        feed its argmax as the next tokens and report the\n"
          "                        max |logit difference| and the top-1 agreement\n"
          "  --no-progress         no progress bar (it is drawn only on a terminal anyway)\n"
          "  -v, --verbose         the library's log down to debug\n"
          "  --version             this program's and the loaded library's version\n"
          "  -h, --help\n"
          "\n"
          "A value follows its flag as the next argument or after '=' (--steps 8,\n"
          "--steps=8); switches take none. N is decimal digits only (no sign, blank or\n"
          "0x): 010 is ten. F is digits[.digits] with an optional exponent\n"
          "e[+|-]digits (55.4, 1e6, 2.5e-1); a sign or blank in front, .5, 5., hex,\n"
          "inf and nan are refused.\n",
          MODEL_MAX_BATCH);
}

/* The CLI's compile-time version and the version of the libactivekv actually
 * loaded (they differ when the dynamic linker found another build). */
static void print_version(void) {
  printf("activekv %d.%d.%d (libactivekv %s loaded; CUDA model %s)\n", AKV_VERSION_MAJOR,
         AKV_VERSION_MINOR, AKV_VERSION_PATCH, akv_version_string(),
#ifdef ACTIVEKV_CUDA_MODEL
         "built"
#else
         "not built"
#endif
  );
}

/*
 * Integers are decimal digits and nothing else: no sign, no blank, no base
 * prefix. strtoull alone skips leading blanks and takes a sign (" -1" was
 * read as 2^64 - 1) and, in base 0, reads "010" as 8 and refuses "08".
 */
/* The end of the run of decimal digits s starts with; NULL when none. */
static const char *digits_end(const char *s) {
  if (!(*s >= '0' && *s <= '9')) return NULL;
  while (*s >= '0' && *s <= '9') s++;
  return s;
}

static int parse_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  if (s == NULL || digits_end(s) == NULL) goto bad;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) goto bad;
  *out = v;
  return 0;
bad:
  say_error("%s: expected an integer in %llu..%llu, got '%s'", flag, (unsigned long long)lo,
            (unsigned long long)hi, s ? s : "");
  return -1;
}

static int parse_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
  uint64_t v;
  if (parse_u64(flag, s, lo, hi, &v)) return -1;
  *out = (uint32_t)v;
  return 0;
}

/*
 * Decimal values are digits[.digits][(e|E)[+|-]digits] and nothing else: no
 * sign or blank in front, no hex ("0x1p4"), no inf or nan, no bare "." at
 * either end (".5", "5."). strtod alone takes all of those (" +0x1p4" was 16).
 * The checked text is then read by strtod in the C locale, which keeps its
 * rounding; a value it cannot hold (1e999, 1e-999) sets errno and is refused.
 */
static int decimal_syntax_ok(const char *s) {
  if ((s = digits_end(s)) == NULL) return 0;
  if (*s == '.' && (s = digits_end(s + 1)) == NULL) return 0;
  if (*s == 'e' || *s == 'E') {
    s++;
    if (*s == '+' || *s == '-') s++;
    if ((s = digits_end(s)) == NULL) return 0;
  }
  return *s == '\0';
}

static int parse_double(const char *flag, const char *s, double lo, double hi, double *out) {
  char *end = NULL;
  errno = 0;
  if (s == NULL || !decimal_syntax_ok(s)) goto bad;
  double v = strtod(s, &end);
  if (errno != 0 || *end != '\0' || !(v >= lo && v <= hi)) goto bad;
  *out = v;
  return 0;
bad:
  say_error("%s: expected a decimal number in %g..%g (digits[.digits][e[+|-]digits]), got '%s'",
            flag, lo, hi, s ? s : "");
  return -1;
}

/*
 * --tokens N[,N...]. Every comma separates two values: an empty entry
 * ("10,,20", ",10", "10,") is refused, never skipped, so the list the run
 * uses is exactly the list that was typed.
 */
static int parse_tokens(const char *s, cli_opts *o) {
  /* A copy of any length: a legal list may be long (leading zeros are
   * digits, "0000000064" is 64), and a fixed buffer refused it as too many
   * values. */
  char *buf = strdup(s);
  int rc = -1;
  if (buf == NULL) {
    say_error("--tokens: out of host memory for its value");
    return -1;
  }
  uint32_t n = 0;
  for (char *t = buf;;) {
    char *comma = strchr(t, ',');
    if (comma) *comma = '\0';
    if (*t == '\0') {
      say_error("--tokens: entry %u of '%s' is empty; expected N or N,N,...", n + 1, s);
      goto out;
    }
    if (n == MAX_LIST) {
      say_error("--tokens: at most %d values", MAX_LIST);
      goto out;
    }
    if (parse_u32("--tokens", t, 0, 1u << 30, &o->tokens[n])) goto out;
    n++;
    if (comma == NULL) break;
    t = comma + 1;
  }
  o->n_tokens = n;
  rc = 0;
out:
  free(buf);
  return rc;
}

static const preset *find_preset(const char *name) {
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; ++i)
    if (strcmp(presets[i].name, name) == 0) return &presets[i];
  return NULL;
}

/*
 * Parses argv[first..] into o. Geometry flags are applied after the preset,
 * whatever their order. Returns 0, or an exit status (-1 for --help).
 */
static int parse_args(int argc, char **argv, int first, cli_opts *o) {
  uint32_t geo[7];
  int geo_set[7] = {0};
  double theta = 0.0;
  int theta_set = 0;
  uint32_t window = 0, every = 0;
  int window_set = 0, every_set = 0;
  static const char *const geo_flags[7] = {"--layers", "--heads",  "--kv-heads", "--head-dim",
                                           "--hidden", "--ffn",    "--vocab"};
  for (int i = first; i < argc; ++i) {
    char *arg = argv[i], *val = NULL;
    char name[64];
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
      usage(stdout);
      return -1;
    }
    if (strcmp(arg, "--version") == 0) {
      print_version();
      return -1;
    }
    if (strcmp(arg, "-v") == 0 || strcmp(arg, "--verbose") == 0) {
      o->verbose = 1;
      continue;
    }
    if (strncmp(arg, "--", 2) != 0) {
      say_error("unexpected argument '%s' (see activekv --help)", arg);
      return EXIT_USAGE;
    }
    const char *eq = strchr(arg, '=');
    size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
    const size_t full_len = nlen; /* quoted whole in "unknown option" */
    if (nlen >= sizeof name) nlen = sizeof name - 1;
    memcpy(name, arg, nlen);
    name[nlen] = '\0';

    /* The switches handled above (--help, --version, --verbose) take no
     * value either: "--verbose=1" is named as such, not as an unknown
     * option. */
    if (eq != NULL && (strcmp(name, "--help") == 0 || strcmp(name, "--version") == 0 ||
                       strcmp(name, "--verbose") == 0)) {
      say_error("%s takes no value, got '%s' (see activekv --help)", name, arg);
      return EXIT_USAGE;
    }

    /* switches */
    int *flag = NULL;
    if (strcmp(name, "--check") == 0) flag = &o->check;
    else if (strcmp(name, "--json") == 0) flag = &o->json;
    /* A switch takes no value: "--check=0" would otherwise turn checking on. */
    if ((flag || strcmp(name, "--no-progress") == 0) && eq != NULL) {
      say_error("%s takes no value, got '%s' (see activekv --help)", name, arg);
      return EXIT_USAGE;
    }
    if (flag) {
      *flag = 1;
      continue;
    }
    if (strcmp(name, "--no-progress") == 0) {
      o->progress = 0;
      continue;
    }

    /* everything else takes a value */
    static const char *const valued[] = {
        "--preset",       "--rope-theta",     "--seed",          "--contexts",      "--tokens",
        "--steps",        "--warmup",         "--route",         "--backend",       "--device",
        "--host-pool-gib", "--device-pool-gib", "--page-tokens", "--chunk-tokens",
        "--headroom-gib", "--headroom-reserve-gib", "--release-headroom-at", "--host-device-mib",
        "--target-pages", "--burst-pages",    "--fit-mode",      "--host-delay-us",
        "--host-delay-seed", "--fail-nth", "--pcie-gbps",   "--layers",        "--heads",         "--kv-heads",
        "--head-dim",     "--hidden",         "--ffn",           "--vocab", "--window",
        "--dense-every",  "--kv-dtype",       "--logits-out",    "--logits-ref",    "--tp"};
    int known = 0;
    for (size_t k = 0; k < sizeof valued / sizeof valued[0]; ++k) known |= !strcmp(name, valued[k]);
    if (!known) {
      say_error("unknown option %.*s (see activekv --help)", (int)full_len, arg);
      return EXIT_USAGE;
    }
    if (eq) val = (char *)eq + 1;
    else if (i + 1 < argc) val = argv[++i];
    else {
      say_error("%s needs a value (see activekv --help)", name);
      return EXIT_USAGE;
    }

    int rc = 0, matched = 0;
    for (int k = 0; k < 7; ++k) {
      if (strcmp(name, geo_flags[k]) == 0) {
        rc = parse_u32(name, val, 1, 1u << 24, &geo[k]);
        geo_set[k] = 1;
        matched = 1;
      }
    }
    if (matched) {
      if (rc) return EXIT_USAGE;
      continue;
    }
    if (strcmp(name, "--preset") == 0) {
      const preset *p = find_preset(val);
      if (p == NULL) {
        say_error("--preset: unknown '%s'; choose llama3-8b, llama3.2-1b, gemma3-12b or tiny",
                  val);
        return EXIT_USAGE;
      }
      o->preset = p->name;
      o->g = p->g;
      o->preset_set = 1;
    } else if (strcmp(name, "--window") == 0) {
      rc = parse_u32(name, val, 0, 1u << 24, &window);
      window_set = 1;
    } else if (strcmp(name, "--dense-every") == 0) {
      rc = parse_u32(name, val, 1, 1u << 16, &every);
      every_set = 1;
    } else if (strcmp(name, "--rope-theta") == 0) {
      rc = parse_double(name, val, 1.0, 1e9, &theta);
      theta_set = 1;
    } else if (strcmp(name, "--seed") == 0) {
      rc = parse_u64(name, val, 0, UINT64_MAX, &o->seed);
      o->seed_set = 1;
    } else if (strcmp(name, "--contexts") == 0) {
      rc = parse_u32(name, val, 1, MODEL_MAX_BATCH, &o->contexts);
    } else if (strcmp(name, "--tokens") == 0) {
      rc = parse_tokens(val, o);
    } else if (strcmp(name, "--steps") == 0) {
      rc = parse_u32(name, val, 1, 1000000, &o->steps);
    } else if (strcmp(name, "--warmup") == 0) {
      rc = parse_u32(name, val, 0, 1000000, &o->warmup);
    } else if (strcmp(name, "--kv-dtype") == 0) {
      if (strcmp(val, "bf16") == 0) o->kv_dtype = AKV_DTYPE_BF16;
      else if (strcmp(val, "fp8") == 0 || strcmp(val, "fp8-e4m3") == 0)
        o->kv_dtype = AKV_DTYPE_FP8_E4M3;
      else {
        say_error("--kv-dtype: unknown '%s'; choose bf16 or fp8", val);
        return EXIT_USAGE;
      }
    } else if (strcmp(name, "--logits-out") == 0) {
      o->logits_out = val;
    } else if (strcmp(name, "--logits-ref") == 0) {
      o->logits_ref = val;
    } else if (strcmp(name, "--route") == 0) {
      if (strcmp(val, "resident") == 0) o->route = ROUTE_RESIDENT;
      else if (strcmp(val, "stage") == 0) o->route = ROUTE_STAGE;
      else if (strcmp(val, "arena") == 0) o->route = ROUTE_ARENA;
      else if (strcmp(val, "paged") == 0) o->route = ROUTE_PAGED;
      else {
        say_error("--route: unknown '%s'; choose resident, stage, arena or paged", val);
        return EXIT_USAGE;
      }
    } else if (strcmp(name, "--backend") == 0) {
      if (strcmp(val, "auto") == 0) o->backend = AKV_BACKEND_AUTO;
      else if (strcmp(val, "host") == 0) o->backend = AKV_BACKEND_HOST;
      else if (strcmp(val, "cuda") == 0) o->backend = AKV_BACKEND_CUDA;
      else {
        say_error("--backend: unknown '%s'; choose auto, host or cuda", val);
        return EXIT_USAGE;
      }
    } else if (strcmp(name, "--device") == 0) {
      uint32_t d = 0; /* set by parse_u32 when rc is 0; read only then */
      rc = parse_u32(name, val, 0, 1023, &d);
      o->device = (int)d;
    } else if (strcmp(name, "--host-pool-gib") == 0) {
      rc = parse_u32(name, val, 1, 1u << 20, &o->host_pool_gib);
    } else if (strcmp(name, "--device-pool-gib") == 0) {
      rc = parse_u32(name, val, 0, 1u << 20, &o->device_pool_gib);
    } else if (strcmp(name, "--headroom-gib") == 0) {
      rc = parse_u32(name, val, 0, 1u << 20, &o->headroom_gib);
    } else if (strcmp(name, "--headroom-reserve-gib") == 0) {
      rc = parse_u32(name, val, 0, 1u << 20, &o->headroom_reserve_gib);
    } else if (strcmp(name, "--host-device-mib") == 0) {
      rc = parse_u32(name, val, 0, 1u << 30, &o->host_device_mib);
    } else if (strcmp(name, "--release-headroom-at") == 0) {
      rc = parse_u32(name, val, 1, UINT32_MAX, &o->release_headroom_at);
    } else if (strcmp(name, "--page-tokens") == 0) {
      rc = parse_u32(name, val, 1, 1u << 20, &o->page_tokens);
    } else if (strcmp(name, "--chunk-tokens") == 0) {
      rc = parse_u32(name, val, 1, 1u << 20, &o->chunk_tokens);
    } else if (strcmp(name, "--target-pages") == 0) {
      rc = parse_u32(name, val, 0, UINT32_MAX - 1, &o->target_pages);
    } else if (strcmp(name, "--burst-pages") == 0) {
      rc = parse_u32(name, val, 0, UINT32_MAX - 1, &o->burst_pages);
    } else if (strcmp(name, "--fit-mode") == 0) {
      if (strcmp(val, "refuse") == 0) o->fit_mode = AKV_FIT_REFUSE;
      else if (strcmp(val, "shrink") == 0) o->fit_mode = AKV_FIT_SHRINK;
      else {
        say_error("--fit-mode: unknown '%s'; choose refuse or shrink", val);
        return EXIT_USAGE;
      }
    } else if (strcmp(name, "--host-delay-us") == 0) {
      rc = parse_u32(name, val, 0, 1000000, &o->delay_max_us);
    } else if (strcmp(name, "--host-delay-seed") == 0) {
      rc = parse_u64(name, val, 1, UINT64_MAX, &o->delay_seed);
      o->delay_seed_set = 1;
    } else if (strcmp(name, "--tp") == 0) {
      rc = parse_u32(name, val, 1, TP_MAX, &o->tp);
    } else if (strcmp(name, "--fail-nth") == 0) {
      rc = parse_u32(name, val, 0, UINT32_MAX, &o->fail_nth);
    } else if (strcmp(name, "--pcie-gbps") == 0) {
      rc = parse_double(name, val, 0.001, 1e6, &o->pcie_gbps);
      o->pcie_set = 1;
    }
    if (rc) return EXIT_USAGE;
  }

  /* Context i takes --tokens value i % n (the list is taken in turn), so a
   * value past the --contexts-th would never be taken: refused, whatever
   * the order of the two flags, rather than dropped without a word. */
  if (o->n_tokens > o->contexts) {
    say_error("--tokens: %u values for --contexts %u; the contexts take the first %u, so the "
              "rest would never be used: give at most %u values, or raise --contexts",
              o->n_tokens, o->contexts, o->contexts, o->contexts);
    return EXIT_USAGE;
  }

  /* Without --preset the model must run on the backend this run uses: the
   * CPU model holds MODEL_CPU_MAX_PARAMS, so the host backend (no GPU, or
   * --backend host) defaults to tiny, as the demo does; CUDA to
   * llama3.2-1b. Geometry flags then override the chosen preset. */
  if (!o->preset_set && resolve_backend(o) == AKV_BACKEND_HOST) {
    o->preset = "tiny";
    o->g = find_preset("tiny")->g;
    o->preset_defaulted = 1;
  }

  uint32_t *dst[7] = {&o->g.n_layers, &o->g.n_heads, &o->g.kv_heads, &o->g.head_dim,
                      &o->g.hidden,   &o->g.ffn,     &o->g.vocab};
  for (int k = 0; k < 7; ++k)
    if (geo_set[k]) *dst[k] = geo[k];
  if (theta_set) o->g.rope_theta = (float)theta;

  const model_geometry *g = &o->g;
  if (g->n_heads % g->kv_heads != 0) {
    say_error("--heads %u is not a multiple of --kv-heads %u", g->n_heads, g->kv_heads);
    return EXIT_USAGE;
  }
  if (g->head_dim % 8 != 0 || g->hidden % 8 != 0 || g->ffn % 8 != 0) {
    say_error("--head-dim, --hidden and --ffn must be multiples of 8 (got %u, %u, %u)",
              g->head_dim, g->hidden, g->ffn);
    return EXIT_USAGE;
  }
  if (window_set) o->g.window = window;
  if (every_set) o->g.dense_every = every;
  if (window_set && window > 0 && !every_set && o->g.dense_every < 2) o->g.dense_every = 6;
  if (every_set && o->g.window == 0 && every > 1) {
    say_error("--dense-every %u needs --window (the sliding window of the other layers); "
              "without one every layer is dense",
              every);
    return EXIT_USAGE;
  }
  char herr[256];
  if (model_hybrid_check(g, herr, sizeof herr) != 0) {
    /* A --dense-every the user did not type is named as what --window set. */
    if (window_set && window > 0 && !every_set)
      say_error("%s (--window without --dense-every takes --dense-every %u: every %u-th layer "
                "dense, the others sliding)",
                herr, o->g.dense_every, o->g.dense_every);
    else
      say_error("%s", herr);
    return EXIT_USAGE;
  }
  if ((uint64_t)max_history(o) + o->warmup + o->steps > UINT32_MAX / 2) {
    say_error("--tokens plus --warmup plus --steps is too large");
    return EXIT_USAGE;
  }
  if (o->tp > 0) {
    if (g->kv_heads % o->tp != 0 || g->n_heads % o->tp != 0 || g->ffn % o->tp != 0 ||
        (g->ffn / o->tp) % 8 != 0) {
      say_error("--tp %u: the %u kv heads, %u heads and ffn %u must each divide by %u (and "
                "ffn / %u stay a multiple of 8); choose another --tp",
                o->tp, g->kv_heads, g->n_heads, g->ffn, o->tp, o->tp);
      return EXIT_USAGE;
    }
    if (o->tp > 1 && o->kv_dtype != AKV_DTYPE_BF16) {
      say_error("--tp %u: FP8 K/V is not sharded yet (its per-head scales); use --kv-dtype bf16",
                o->tp);
      return EXIT_USAGE;
    }
  }
  lib_verbose = o->verbose;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Engine configuration and fit                                              */
/* ------------------------------------------------------------------------ */

static void engine_config(const cli_opts *o, akv_backend_kind backend, akv_engine_config *c) {
  akv_engine_config_init(c);
  c->backend = backend;
  c->device_ordinal = o->device;
  c->n_dense_layers = model_dense_layers(&o->g); /* sliding-window layers are not staged */
  c->kv_heads = o->g.kv_heads;
  c->head_dim = o->g.head_dim;
  c->dtype = o->kv_dtype; /* the engine moves the bytes; the scales stay in the model */
  c->max_tokens = max_tokens(o);
  c->page_tokens = o->page_tokens;
  c->host_pool_gib = o->host_pool_gib;
  c->device_pool_gib = o->device_pool_gib;
  c->max_contexts = o->contexts;
  c->fit_mode = o->fit_mode;
  c->route = o->route == ROUTE_PAGED                              ? AKV_ROUTE_PAGED
             : o->route == ROUTE_ARENA || o->device_pool_gib > 0 ? AKV_ROUTE_ARENA
                                                                 : AKV_ROUTE_STAGE;
  c->log_fn = lib_log;
  c->log_user = NULL;
  c->log_level = o->verbose ? AKV_LOG_DEBUG : AKV_LOG_WARN;
  c->host_delay_seed = o->delay_max_us ? o->delay_seed : 0;
  c->host_delay_max_us = o->delay_max_us;
  c->fault_fail_nth = o->fail_nth;
  c->headroom_gib = o->headroom_gib;
  c->headroom_reserve_gib = o->headroom_reserve_gib;
  c->host_fake_free_bytes = (uint64_t)o->host_device_mib << 20;
}

/*
 * Fills the config and runs akv_fit. Without --host-pool-gib the pool is the
 * smallest whole GiB that holds --contexts histories (the formula's own
 * answer, printed as such; never a size taken from free memory).
 */
static int fit_config(const cli_opts *o, akv_backend_kind backend, akv_engine_config *c,
                      akv_fit_report *r, int *pool_chosen) {
  akv_status st = AKV_OK;
  engine_config(o, backend, c);
  *pool_chosen = 0;
  /* akv_fit says only "invalid configuration"; name the flag for the usual causes. */
  if (c->page_tokens > c->max_tokens) {
    say_error("--page-tokens %u is longer than a context can get (%u rows: the longest --tokens "
              "plus --warmup plus --steps); lower --page-tokens",
              c->page_tokens, c->max_tokens);
    return -1;
  }
  /* Saturating: the plain product wrapped 64 bits for huge geometries (2^65
   * bytes read as 0) and passed the comparison with the pool. */
  uint64_t page_bytes = model_sat_mul(
      model_sat_mul(model_sat_mul((uint64_t)c->page_tokens, c->n_dense_layers),
                    model_sat_mul(c->kv_heads, c->head_dim)),
      2u * (uint64_t)model_kv_elem_bytes(o->kv_dtype));
  if (c->route != AKV_ROUTE_STAGE && c->device_pool_gib > 0 &&
      page_bytes > (uint64_t)c->device_pool_gib * GIB) { /* stage never allocates the pool */
    say_error("--device-pool-gib %u holds no page of %s%llu bytes (--page-tokens %u); raise "
              "--device-pool-gib or lower --page-tokens",
              c->device_pool_gib, page_bytes == UINT64_MAX ? "more than " : "",
              (unsigned long long)page_bytes, c->page_tokens);
    return -1;
  }
  lib_last[0] = '\0'; /* the reason of a refusal below, from the library's log */
  if (c->host_pool_gib == 0) {
    c->host_pool_gib = 1;
    st = akv_fit(c, r);
    if (st == AKV_OK) {
      c->host_pool_gib = r->host_pool_gib_needed ? r->host_pool_gib_needed : 1;
      *pool_chosen = 1;
    }
  }
  if (st == AKV_OK) st = akv_fit(c, r);
  if (st == AKV_OK) return 0;
  /* A device pool of more pages than a page number holds was blamed on the
   * geometry flags, none of which was at fault: named by its flag. */
  if (strstr(lib_last, "device_pool_gib=") != NULL)
    say_error("--device-pool-gib %u: akv_fit: %s (%s); lower --device-pool-gib or raise "
              "--page-tokens",
              c->device_pool_gib, akv_status_string(st), lib_last);
  else
    say_error("akv_fit: %s for %u layers x %u kv heads x head_dim %u x %u tokens "
              "(check --layers, --kv-heads, --head-dim, --tokens, --page-tokens)",
              akv_status_string(st), c->n_dense_layers, c->kv_heads, c->head_dim, c->max_tokens);
  return -1;
}

static void say_no_fit(const cli_opts *o, const akv_fit_report *r) {
  unsigned pool = (unsigned)(r->host_pool_bytes / GIB);
  if (r->fits == 0)
    say_error("the host pool of %u GiB holds no history of %llu bytes (--tokens plus --warmup "
              "plus --steps rows of every layer); raise --host-pool-gib to %u or lower --tokens",
              pool, (unsigned long long)r->history_bytes, r->host_pool_gib_needed);
  else
    say_error("the host pool of %u GiB holds %llu of --contexts %u histories of %llu bytes; "
              "raise --host-pool-gib to %u or lower --contexts to %llu%s",
              pool, (unsigned long long)r->fits, o->contexts,
              (unsigned long long)r->history_bytes, r->host_pool_gib_needed,
              (unsigned long long)r->fits,
              o->fit_mode == AKV_FIT_REFUSE ? " (or pass --fit-mode shrink to run what fits)" : "");
}

/* ------------------------------------------------------------------------ */
/* A run: one route over prefilled contexts, optionally checked              */
/* ------------------------------------------------------------------------ */

typedef struct run_result {
  akv_backend_kind backend;
  cli_route route;
  uint32_t contexts, queued;
  uint32_t steps;
  double tokens_per_s, step_ms_median, step_ms_p90, step_ms_mean;
  double resident_tokens_per_s, resident_step_ms_median;
  double prefill_s;
  uint64_t bytes_h2d, bytes_d2d, bytes_d2h; /* per measured step */
  uint64_t bytes_in_place;                  /* paged route, per measured step */
  uint64_t engine_device_bytes, engine_staging_bytes, device_peak_bytes;
  uint32_t device_pages;
  uint64_t host_pool_bytes, history_bytes;
  model_memory mem;
  uint64_t adm[AKV_ADM_RULE_COUNT];
  int have_engine;
  int checked;
  uint32_t steps_compared, mismatched_steps, first_mismatch;
  double max_abs_diff;
  /* --logits-ref: distance from the reference run's logits, every step */
  int ref_compared;
  uint32_t ref_steps, ref_top1_agree, ref_top1_total;
  double ref_max_abs_diff;
  akv_fit_report fit;
  uint32_t host_pool_gib;
  int host_pool_chosen;
  /* Headroom: at create, and the timed release (--release-headroom-at). */
  uint32_t headroom_pages;
  uint64_t headroom_bytes;
  uint32_t release_step;        /* 0: no release happened */
  uint64_t released_bytes;
  double release_call_ms;       /* the akv_headroom_release call itself */
  double release_reusable_ms;   /* request to memory freed (the step's end) */
  double *step_ms;              /* [steps incl. warmup] when a release was asked for */
  uint32_t n_step_ms;
  /* --tp: ranks, and each rank's bytes per measured step (own link each) */
  uint32_t tp;
  int tp_nccl; /* the ranks are GPUs agreeing through NCCL (else in-process, host) */
  uint64_t rank_h2d[TP_MAX], rank_d2d[TP_MAX], rank_d2h[TP_MAX];
} run_result;

/* Frees what a run_result owns (the per-step times of a headroom release)
 * and clears the pointer. Invariant: every run_result a run filled is freed
 * once, by whoever reports it (cmd_decode) or by the run that failed. */
static void run_result_free(run_result *res) {
  free(res->step_ms);
  res->step_ms = NULL;
  res->n_step_ms = 0;
}

/*
 * --tp: the ranks of one process. Each rank is a thread with its own engine
 * and its own model shard, the engines bound into one akv_group.
 *
 * Host backend: the group is on the in-process world, and the model's
 * all-reduce is this: every rank posts its partial vector, then every rank
 * sums the posted vectors in rank order 0..N-1 (the same fp32 additions on
 * every rank, so the same bits everywhere, run after run), then the ranks
 * wait for each other before the vectors are reused.
 *
 * CUDA backend (built with NCCL): rank r runs on GPU r; the group is on the
 * rank's NCCL communicator and the model's all-reduce is ncclAllReduce on
 * the model's stream over a second communicator (tp_nccl.h). The mutex and
 * condition below still serve the host-side barrier before the first step
 * and the end of the ranks.
 */
typedef struct tp_world {
  uint32_t n;
  akv_group_world *gw;  /* host backend (NULL on CUDA) */
  struct tp_nccl *nccl; /* CUDA backend: the communicators (NULL on host) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t arrived;
  uint64_t generation;
  int aborted;
  uint32_t finished; /* rank threads that returned */
  float *posted[TP_MAX];
} tp_world;

typedef struct tp_rank {
  tp_world *w;
  uint32_t rank;
  float *sum; /* [cap] */
  uint64_t cap;
} tp_rank;

/* Every rank arrives, or -1 once a rank aborted the world. */
static int tp_barrier(tp_world *w) {
  int rc;
  pthread_mutex_lock(&w->mu);
  const uint64_t gen = w->generation;
  if (!w->aborted && ++w->arrived == w->n) {
    w->arrived = 0;
    w->generation++;
    pthread_cond_broadcast(&w->cv);
  } else {
    while (!w->aborted && w->generation == gen) pthread_cond_wait(&w->cv, &w->mu);
  }
  rc = w->aborted ? -1 : 0;
  pthread_mutex_unlock(&w->mu);
  return rc;
}

/* 1 once a rank aborted the world. */
static int tp_aborted(tp_world *w) {
  pthread_mutex_lock(&w->mu);
  const int a = w->aborted;
  pthread_mutex_unlock(&w->mu);
  return a;
}

/* A rank failed: the others stop at their next all-reduce or agreement. */
static void tp_abort(tp_world *w) {
  pthread_mutex_lock(&w->mu);
  w->aborted = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  if (w->gw) akv_group_world_abort(w->gw);
}

/* model_options.allreduce: v[0..n) becomes the sum over ranks, rank order. */
static int tp_allreduce(void *user, float *v, uint64_t n) {
  tp_rank *t = user;
  tp_world *w = t->w;
  if (w->n == 1) return 0; /* one rank: the sum is v itself */
  if (n > t->cap) return -1;
  w->posted[t->rank] = v;
  if (tp_barrier(w) != 0) return -1;
  for (uint64_t i = 0; i < n; ++i) {
    float acc = w->posted[0][i];
    for (uint32_t r = 1; r < w->n; ++r) acc += w->posted[r][i];
    t->sum[i] = acc;
  }
  if (tp_barrier(w) != 0) return -1; /* every rank has read every v */
  memcpy(v, t->sum, n * sizeof(float));
  return 0;
}

typedef struct runner runner;

/* What the attention hook hands to a host-queue function: one per dense layer. */
typedef struct layer_slot {
  runner *r;
  uint32_t layer; /* the model's layer index */
  model_kv_view kv;
  uint32_t len[MODEL_MAX_BATCH];
  int failed;
} layer_slot;

struct runner {
  const cli_opts *o;
  model *m;
  akv_engine *engine; /* --tp: the group's engine */
  akv_group *group;   /* --tp: this rank's group (NULL otherwise) */
  tp_rank *tp;        /* --tp: this rank */
  akv_backend_kind backend;
  akv_stream stream;
  int own_stream;
  uint32_t n_ctx;
  akv_context *ctx[MODEL_MAX_BATCH];
  uint32_t n_dense;  /* the engine's layers: the model's dense ones */
  akv_lease **lease; /* [n_dense], the open step's leases not yet retired */
  uint32_t retire_from; /* every lease below this one is retired */
  layer_slot *slot;  /* [n_dense] */
  uint32_t win_lanes; /* hybrid: the model's window lanes (route 0, resident 1 beside it) */
  uint32_t res_lane;  /* the window lane of resident steps */
  int step_open;     /* between akv_step_begin and a successful akv_step_end */
  uint32_t res_len[MODEL_MAX_BATCH];
  uint32_t step_no;        /* 1-based engine step in progress */
  double release_t0;       /* when the headroom release was asked for; 0: none pending */
  uint64_t backend_ops;    /* the engine's backend operations, read before its destroy */
  run_result *res;
  char err[768];
};

static void run_fail(runner *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void run_fail(runner *r, const char *fmt, ...) {
  if (r->err[0]) return; /* keep the first cause */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->err, sizeof r->err, fmt, ap);
  va_end(ap);
}

static void run_fail_akv(runner *r, const char *what, akv_status st) {
  run_fail(r, "%s: %s (%s)", what, akv_status_string(st),
           r->engine ? akv_engine_last_error(r->engine) : lib_last);
}

/* Host backend: the queue worker runs the CPU attention of one layer. */
static void slot_run(void *arg) {
  layer_slot *s = arg;
  if (model_attend(s->r->m, s->layer, &s->kv) != 0) s->failed = 1;
}

/* The akv_attention_fn of the staged routes. */
static int attention_hook(void *user, const akv_view *view, akv_stream stream) {
  runner *r = user;
  const model_geometry *g = &r->m->g;
  if (view->layer >= r->n_dense || view->n_contexts != r->n_ctx ||
      view->kv_heads != g->kv_heads || view->head_dim != g->head_dim ||
      view->dtype != r->o->kv_dtype) {
    run_fail(r, "hook: the view (layer %u, %u contexts, %u x %u) does not match the model",
             view->layer, view->n_contexts, view->kv_heads, view->head_dim);
    return 1;
  }
  layer_slot *s = &r->slot[view->layer];
  s->r = r;
  s->layer = model_dense_layer(g, view->layer); /* the engine counts dense layers only */
  s->failed = 0;
  memcpy(s->len, view->len, view->n_contexts * sizeof(uint32_t));
  s->kv = *view;
  s->kv.len = s->len; /* the slot's copy: the CPU model reads it on the queue */
  if (model_stream(r->m) == NULL) {
    akv_status st = akv_stream_launch_host(r->engine, stream, slot_run, s);
    if (st != AKV_OK) {
      run_fail_akv(r, "akv_stream_launch_host", st);
      return 1;
    }
    return 0;
  }
  /* CUDA: the stream is the model's own; model_attend enqueues on it. */
  if (stream != (akv_stream)model_stream(r->m)) {
    run_fail(r, "hook: layer %u was attended on a stream other than the model's", view->layer);
    return 1;
  }
  if (model_attend(r->m, s->layer, &s->kv) != 0) {
    run_fail(r, "layer %u: %s", s->layer, model_error(r->m));
    return 1;
  }
  return 0;
}

static int retire(runner *r, uint32_t layer) {
  if (r->lease[layer] == NULL) return 0;
  akv_receipt receipt;
  akv_status st = akv_lease_retire(r->lease[layer], &receipt);
  r->lease[layer] = NULL;
  if (st != AKV_OK) {
    run_fail_akv(r, "akv_lease_retire", st);
    return -1;
  }
  return 0;
}

/* Retires, without blocking, the step's leases [retire_from, upto] whose
 * fences have passed, oldest first; stops at the first not ready (the rest
 * are later on the same queues). The host never waits here: the leases left
 * are retired at the end of the step. */
static int retire_ready(runner *r, uint32_t upto) {
  for (; r->retire_from <= upto && r->retire_from < r->n_dense; ++r->retire_from) {
    const uint32_t j = r->retire_from;
    if (r->lease[j] == NULL) continue;
    akv_receipt receipt;
    const akv_status st = akv_lease_try_retire(r->lease[j], &receipt);
    if (st == AKV_ERR_NOT_READY) return 0;
    r->lease[j] = NULL;
    if (st != AKV_OK) {
      run_fail_akv(r, "akv_lease_try_retire", st);
      return -1;
    }
  }
  return 0;
}

/* A layer that fails once its attention may be enqueued (akv_lease_attend,
 * write back, seal or the wait below failed): on the host backend the hook's
 * job may still run on the stream's thread, reading the CPU model's layer
 * state, which the model's forward resets as soon as the layer function
 * returns (a data race, and the job could refuse or write the model's error
 * meanwhile). The stream is drained first; where it cannot establish
 * completion (the transport failed), the engine's quarantine does, as
 * close_all would have later. */
static void layer_drain(runner *r) {
  akv_quarantine_report qr;
  if (model_stream(r->m) != NULL) return; /* CUDA: the model's own stream, no host state */
  if (akv_stream_synchronize(r->engine, r->stream) == AKV_OK) return;
  akv_engine_quarantine(r->engine, &qr);
}

/* model_layer_fn of the staged routes: one lease per dense layer (model
 * layer ml is the engine's layer l). */
static int layer_engine(void *user, model *m, uint32_t ml) {
  runner *r = user;
  akv_status st;
  akv_fence attn, tail;
  const uint32_t l = model_dense_before(&m->g, ml);
  if ((st = akv_lease_begin(r->engine, l, &r->lease[l])) != AKV_OK) {
    r->lease[l] = NULL;
    run_fail_akv(r, "akv_lease_begin", st);
    return -1;
  }
  if (l >= 2 && retire_ready(r, l - 2) != 0) return -1;
  if (r->o->release_headroom_at == r->step_no && l == r->n_dense / 2 && r->res != NULL &&
      r->res->release_step == 0) {
    /* Mid-step, leases in flight: the engine frees at the step's end. */
    uint64_t now_b = 0, pend_b = 0;
    double t0 = now_s();
    if ((st = akv_headroom_release(r->engine, UINT64_MAX, &now_b, &pend_b)) != AKV_OK) {
      run_fail_akv(r, "akv_headroom_release", st);
      return -1;
    }
    r->res->release_call_ms = (now_s() - t0) * 1e3;
    r->res->release_step = r->step_no;
    r->res->released_bytes = now_b + pend_b;
    r->release_t0 = t0;
  }
  if ((st = akv_lease_attend(r->lease[l], r->stream, attention_hook, r, &attn)) != AKV_OK) {
    run_fail_akv(r, "akv_lease_attend", st);
    layer_drain(r);
    return -1;
  }
  if ((st = akv_lease_write_back(r->lease[l], NULL, 0, &tail)) != AKV_OK) {
    run_fail_akv(r, "akv_lease_write_back", st);
    layer_drain(r);
    return -1;
  }
  if ((st = akv_lease_seal(r->lease[l], tail, attn)) != AKV_OK) {
    run_fail_akv(r, "akv_lease_seal", st);
    layer_drain(r);
    return -1;
  }
  if (model_stream(r->m) == NULL) {
    /* The CPU model computes on this thread: its next layer reads the
     * attention output, so wait for the queue to have run the hook's work. */
    if ((st = akv_stream_synchronize(r->engine, r->stream)) != AKV_OK) {
      run_fail_akv(r, "akv_stream_synchronize", st);
      layer_drain(r);
      return -1;
    }
    if (r->slot[l].failed) {
      run_fail(r, "layer %u: %s", ml, model_error(r->m));
      return -1;
    }
  }
  return 0;
}

/* model_layer_fn of the resident route: the model's own store. */
static int layer_resident(void *user, model *m, uint32_t l) {
  runner *r = user;
  model_kv_view v;
  if (model_resident_view(m, l, r->res_len, r->n_ctx, &v) != 0 || model_attend(m, l, &v) != 0) {
    run_fail(r, "resident layer %u: %s", l, model_error(m));
    return -1;
  }
  return 0;
}

static int step_engine(runner *r, const int32_t *tok, float *logits) {
  uint32_t pos[MODEL_MAX_BATCH];
  akv_status st;
  if (r->tp != NULL && r->tp->w->nccl != NULL && tp_aborted(r->tp->w)) {
    /* CUDA: not into another agreement or all-reduce a failed rank will miss */
    run_fail(r, "rank %u stops: another rank failed", r->tp->rank);
    return -1;
  }
  for (uint32_t i = 0; i < r->n_ctx; ++i) {
    if ((st = akv_context_length(r->ctx[i], &pos[i])) != AKV_OK) {
      run_fail_akv(r, "akv_context_length", st);
      return -1;
    }
  }
  st = r->group ? akv_group_step_begin(r->group, r->ctx, r->n_ctx)
               : akv_step_begin(r->engine, r->ctx, r->n_ctx);
  if (st != AKV_OK) {
    if (r->group)
      run_fail(r, "akv_group_step_begin: %s (%s)", akv_status_string(st),
               akv_group_last_error(r->group));
    else
      run_fail_akv(r, "akv_step_begin", st);
    return -1;
  }
  r->step_open = 1;
  const uint32_t L = r->n_dense;
  for (uint32_t l = 0; l < L; ++l) r->lease[l] = NULL;
  r->retire_from = 0;
  if (model_forward(r->m, 0, r->n_ctx, tok, pos, layer_engine, r, logits) != 0) {
    run_fail(r, "decode step: %s", model_error(r->m));
    return -1;
  }
  /* The leases try_retire left (at least the last two): blocking retire. */
  for (uint32_t l = r->retire_from; l < L; ++l)
    if (retire(r, l) != 0) return -1;
  if ((st = akv_step_end(r->engine)) != AKV_OK) {
    run_fail_akv(r, "akv_step_end", st);
    return -1;
  }
  r->step_open = 0;
  if (r->release_t0 > 0.0) { /* step_end freed the headroom: reusable from here */
    r->res->release_reusable_ms = (now_s() - r->release_t0) * 1e3;
    r->release_t0 = 0.0;
  }
  return 0;
}

static int step_resident(runner *r, const int32_t *tok, float *logits) {
  if (model_forward(r->m, r->res_lane, r->n_ctx, tok, r->res_len, layer_resident, r, logits) !=
      0) {
    run_fail(r, "resident step: %s", model_error(r->m));
    return -1;
  }
  for (uint32_t i = 0; i < r->n_ctx; ++i) r->res_len[i]++;
  return 0;
}

/* The synthetic rows [first, first+n) of context ctx for the model layers
 * layers[0..count): K rows to kp[j], V rows to vp[j], seeded by the model's
 * layer index (the same bytes whichever store they go to). FP8: the bf16
 * history quantized with the layer's fixed scales (one bf16 row of scratch
 * in `tmp`), so the bf16 and FP8 runs of a seed hold the same history. */
static void history_rows(const cli_opts *o, uint32_t kv_dim, uint32_t ctx, uint32_t first,
                         uint32_t n, const uint32_t *layers, uint32_t count, const void **kp,
                         const void **vp, uint16_t *tmp) {
  const uint64_t rb = (uint64_t)kv_dim * model_kv_elem_bytes(o->kv_dtype);
  const uint32_t full_dim = o->full_g.kv_heads * o->full_g.head_dim;
  for (uint32_t j = 0; j < count; ++j) {
    for (uint32_t t = 0; t < n; ++t) {
      for (int kv = 0; kv < 2; ++kv) {
        uint8_t *dst = (uint8_t *)(kv ? vp[j] : kp[j]) + (uint64_t)t * rb;
        if (o->tp > 1) { /* the rank's KV heads of the whole model's row (bf16) */
          model_history_row(o->seed, ctx, layers[j], kv, first + t, tmp, full_dim);
          memcpy(dst, tmp + (uint64_t)o->tp_rank * kv_dim, rb);
        } else if (o->kv_dtype == AKV_DTYPE_FP8_E4M3) {
          model_history_row(o->seed, ctx, layers[j], kv, first + t, tmp, kv_dim);
          model_quantize_row(&o->g, layers[j], kv, tmp, dst);
        } else {
          model_history_row(o->seed, ctx, layers[j], kv, first + t, (uint16_t *)dst, kv_dim);
        }
      }
    }
  }
}

/* Writes the synthetic history of the dense layers through
 * akv_context_append (and into the resident store when it is used), in
 * chunks of every dense layer at once; then, in a hybrid geometry, the last
 * window - 1 tokens of every sliding layer into each window lane. */
static int prefill(runner *r, int to_engine, int to_resident, double *seconds) {
  const cli_opts *o = r->o;
  const model_geometry *g = &r->m->g;
  const uint32_t kv_dim = g->kv_heads * g->head_dim, D = model_dense_layers(g),
                 S = model_window_layers(g), L = D > S ? D : S;
  const uint64_t row_bytes = (uint64_t)kv_dim * model_kv_elem_bytes(o->kv_dtype);
  uint64_t chunk = (16u << 20) / (L * row_bytes);
  if (chunk < 1) chunk = 1;
  if (chunk > 4096) chunk = 4096;
  uint8_t *buf = malloc(2 * L * chunk * row_bytes);
  const uint32_t tmp_dim = o->tp > 1 ? o->full_g.kv_heads * o->full_g.head_dim : kv_dim;
  uint16_t *tmp = malloc((uint64_t)tmp_dim * sizeof(uint16_t));
  const void **kp = malloc(L * sizeof *kp), **vp = malloc(L * sizeof *vp);
  uint32_t *dense = malloc(L * sizeof *dense), *slide = malloc(L * sizeof *slide);
  int rc = -1;
  if (buf == NULL || tmp == NULL || kp == NULL || vp == NULL || dense == NULL || slide == NULL) {
    run_fail(r, "prefill: out of host memory");
    goto out;
  }
  for (uint32_t l = 0; l < L; ++l) {
    kp[l] = buf + (uint64_t)(2 * l) * chunk * row_bytes;
    vp[l] = buf + (uint64_t)(2 * l + 1) * chunk * row_bytes;
  }
  for (uint32_t l = 0, d = 0, w = 0; l < g->n_layers; ++l) {
    if (model_layer_dense(g, l)) dense[d++] = l;
    else slide[w++] = l;
  }
  /* sliding layers keep the tokens still in the window of the first step */
  const uint32_t keep = S > 0 ? g->window - 1 : 0;
  uint64_t total = 0, done = 0, bytes = 0;
  for (uint32_t i = 0; i < r->n_ctx; ++i) {
    uint32_t len = ctx_tokens(o, i);
    total += (uint64_t)len * D + (uint64_t)(len < keep ? len : keep) * S * r->win_lanes;
  }
  progress bar;
  progress_begin(&bar, o->progress && !o->json, "prefill", total);
  double t0 = now_s();
  for (int pass = 0; pass < 2; ++pass) {
    const uint32_t count = pass == 0 ? D : S;
    const uint32_t *layers = pass == 0 ? dense : slide;
    if (count == 0 || (pass == 1 && r->win_lanes == 0)) continue;
    for (uint32_t i = 0; i < r->n_ctx; ++i) {
      const uint32_t len = ctx_tokens(o, i), from = pass == 0 || len < keep ? 0 : len - keep;
      for (uint32_t first = from; first < len;) {
        uint32_t n = len - first < chunk ? len - first : (uint32_t)chunk;
        history_rows(o, kv_dim, i, first, n, layers, count, kp, vp, tmp);
        if (pass == 0 && to_engine) {
          akv_status st = akv_context_append(r->ctx[i], n, kp, vp);
          if (st != AKV_OK) {
            run_fail_akv(r, "akv_context_append", st);
            goto out;
          }
        }
        if (pass == 0 && to_resident && model_resident_append(r->m, i, first, n, kp, vp) != 0) {
          run_fail(r, "prefill: %s", model_error(r->m));
          goto out;
        }
        for (uint32_t lane = 0; pass == 1 && lane < r->win_lanes; ++lane) {
          if (model_window_append(r->m, lane, i, first, n, kp, vp) != 0) {
            run_fail(r, "prefill: %s", model_error(r->m));
            goto out;
          }
        }
        const uint32_t copies = pass == 0 ? 1 : r->win_lanes;
        first += n;
        done += (uint64_t)n * count * copies;
        bytes += (uint64_t)n * count * copies * row_bytes * 2;
        char rate[64], b[32];
        double dt = now_s() - t0;
        snprintf(rate, sizeof rate, "%s/s", fmt_xfer(b, sizeof b, dt > 0 ? bytes / dt : 0.0));
        progress_update(&bar, done, rate);
      }
    }
  }
  *seconds = now_s() - t0;
  rc = 0;
out:
  free(buf);
  free(tmp);
  free(kp);
  free(vp);
  free(dense);
  free(slide);
  return rc;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median and nearest-rank p90 of n values (sorted in place). */
static void quantiles(double *v, uint32_t n, double *median, double *p90) {
  qsort(v, n, sizeof *v, cmp_double);
  *median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  uint32_t k = (uint32_t)ceil(0.9 * n);
  *p90 = v[k ? k - 1 : 0];
}

static int32_t argmax(const float *v, uint32_t n) {
  uint32_t best = 0;
  for (uint32_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return (int32_t)best;
}

static int model_make(const cli_opts *o, akv_backend_kind backend, uint32_t n_ctx,
                      tp_rank *tp, model **m, char *err, size_t cap) {
  model_options mo;
  memset(&mo, 0, sizeof mo);
  if (tp != NULL) {
    mo.tp_rank = tp->rank;
    mo.tp_size = tp->w->n;
    if (tp->w->nccl == NULL) {
      mo.allreduce = tp_allreduce;
      mo.allreduce_user = tp;
    } else {
#ifdef ACTIVEKV_NCCL
      mo.allreduce_dev = tp_nccl_allreduce; /* on the model's stream */
      mo.allreduce_user = tp_nccl_user(tp->w->nccl, tp->rank);
#endif
    }
  }
  mo.seed = o->seed;
  mo.max_batch = n_ctx;
  mo.chunk_tokens = chunk_tokens(o);
  mo.max_tokens = max_tokens(o);
  mo.device = o->device;
  mo.kv_dtype = o->kv_dtype;
  if (backend == AKV_BACKEND_HOST) return model_cpu_create(&o->g, &mo, m, err, cap);
#ifdef ACTIVEKV_CUDA_MODEL
  return model_cuda_create(&o->g, &mo, m, err, cap);
#else
  snprintf(err, cap, "this activekv was built without CUDA; use --backend host");
  return -1;
#endif
}

/* The backend the run uses: --backend, or for auto CUDA when a device is there. */
static akv_backend_kind resolve_backend(const cli_opts *o) {
  if (o->backend != AKV_BACKEND_AUTO) return o->backend;
#ifdef ACTIVEKV_CUDA_MODEL
  if (model_cuda_available()) return AKV_BACKEND_CUDA;
#endif
  return AKV_BACKEND_HOST;
}

static const char *backend_name(akv_backend_kind b) {
  return b == AKV_BACKEND_CUDA ? "cuda" : b == AKV_BACKEND_HOST ? "host" : "auto";
}

static void print_counters(const uint64_t *adm) {
  printf("admission:");
  for (int k = 0; k < AKV_ADM_RULE_COUNT; ++k)
    printf("%s %s %llu", k ? "," : "", akv_adm_rule_string((akv_adm_rule)k),
           (unsigned long long)adm[k]);
  printf("\n");
}

/* Destroys the rank's group (CUDA: recording whether it aborted its
 * communicator). */
static akv_status group_destroy(runner *r) {
#ifdef ACTIVEKV_NCCL
  if (r->tp->w->nccl != NULL) return tp_nccl_group_destroy(r->tp->w->nccl, r->tp->rank, r->group);
#endif
  return akv_group_destroy(r->group);
}

/* Creates the engine and opens the contexts (shrink mode may open fewer).
 * Returns 0, or -1 with the message printed. */
static int open_engine(runner *r, const akv_engine_config *cfg, run_result *res) {
  const cli_opts *o = r->o;
  akv_engine_info info;
  akv_status st;
  lib_injected = 0;
  if (r->tp != NULL) {
    /* One rank of the group: its engine created from the agreed config. */
    akv_group_config gc = AKV_GROUP_CONFIG_INIT;
    gc.rank = r->tp->rank;
    gc.size = r->tp->w->n;
    gc.timeout_ms = TP_GROUP_TIMEOUT_MS;
#ifdef ACTIVEKV_NCCL
    if (r->tp->w->nccl != NULL) /* CUDA: rank r's engine on GPU r, agreeing through NCCL */
      st = tp_nccl_group_create(r->tp->w->nccl, r->tp->rank, cfg, &gc, &r->group);
    else
#endif
      st = akv_group_create_inproc(cfg, &gc, r->tp->w->gw, &r->group);
    if (st == AKV_OK) st = akv_group_engine(r->group, &r->engine);
  } else {
    st = akv_engine_create(cfg, &r->engine);
  }
  if (st != AKV_OK) {
    r->engine = NULL;
    if (r->group) group_destroy(r);
    r->group = NULL;
    if (st == AKV_ERR_NO_FIT)
      say_no_fit(o, &res->fit);
    else if (o->fail_nth > 0 && lib_injected)
      /* The fault --fail-nth asked for: no flag of the run is to blame, so
       * none is suggested (it was "lower --host-pool-gib" or "check
       * --page-tokens ..."). */
      say_error("akv_engine_create: %s (%s): the fault --fail-nth %u injected while the engine "
                "was created",
                akv_status_string(st), lib_last, o->fail_nth);
    else if (st == AKV_ERR_OUT_OF_MEMORY && strstr(lib_last, "(device_pool_gib)") != NULL)
      /* The pool that failed is named, and only flags that size it: it
       * said "lower --host-pool-gib or --device-pool-gib" whatever failed,
       * --host-pool-gib when the CLI had chosen the pool. */
      say_error("akv_engine_create: out of memory for a %u GiB device pool (%s); lower "
                "--device-pool-gib%s",
                cfg->device_pool_gib, lib_last,
                o->host_device_mib > 0 ? " or raise --host-device-mib (the modelled device)" : "");
    else if (st == AKV_ERR_OUT_OF_MEMORY && strstr(lib_last, "(host_pool_gib)") != NULL)
      say_error("akv_engine_create: out of memory for a %u GiB pinned host pool (%s); %s",
                cfg->host_pool_gib, lib_last,
                o->host_pool_gib > 0 ? "lower --host-pool-gib"
                                     : "lower --contexts or --tokens (the host pool is the "
                                       "smallest that holds them)");
    else if (st == AKV_ERR_OUT_OF_MEMORY)
      say_error("akv_engine_create: out of memory for a %u GiB pinned host pool and a %u GiB "
                "device pool (%s); lower --host-pool-gib or --device-pool-gib",
                cfg->host_pool_gib, cfg->device_pool_gib, lib_last);
    else if (st == AKV_ERR_NOT_SUPPORTED)
      say_error("akv_engine_create: the %s backend is not available here (%s); use --backend "
                "host",
                backend_name(r->backend), lib_last);
    else
      say_error("akv_engine_create: %s (%s); check --page-tokens, --tokens, --kv-heads, "
                "--head-dim",
                akv_status_string(st), lib_last);
    return -1;
  }
  akv_engine_info_get(r->engine, &info);
  res->backend = info.backend;
  res->have_engine = 1;
  res->engine_device_bytes = info.device_bytes_allocated;
  res->engine_staging_bytes = info.staging_bytes;
  res->device_pages = info.device_pages;
  res->host_pool_bytes = res->fit.host_pool_bytes;
  res->headroom_pages = info.headroom_pages;
  res->headroom_bytes = info.headroom_bytes;
  r->res = res;

  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  cc.target_pages = o->target_pages;
  cc.burst_pages = o->burst_pages;
  for (uint32_t i = 0; i < o->contexts; ++i) {
    st = r->group ? akv_group_context_open(r->group, &cc, &r->ctx[i])
                  : akv_context_open(r->engine, &cc, &r->ctx[i]);
    if (st == AKV_ERR_REFUSED_QUEUE) { /* shrink mode: the rest would queue */
      res->queued = o->contexts - i;
      break;
    }
    if (st == AKV_ERR_ADMISSION_REFUSED) {
      char why[512];
      akv_admission_explain(r->engine, NULL, why, sizeof why);
      size_t n = strlen(why);
      while (n > 0 && (why[n - 1] == '.' || why[n - 1] == ' ' || why[n - 1] == '\n'))
        why[--n] = '\0';
      say_error("context %u of %u refused by the device pool: %s. Lower --target-pages or "
                "--burst-pages, or raise --device-pool-gib",
                i + 1, o->contexts, why);
      return -1;
    }
    if (st != AKV_OK) {
      say_error("akv_context_open: %s (%s)", akv_status_string(st),
                akv_engine_last_error(r->engine));
      return -1;
    }
    r->n_ctx = i + 1;
  }
  if (r->n_ctx == 0) {
    say_error("no context could be opened; raise --host-pool-gib");
    return -1;
  }
  return 0;
}

/* The model, its compute stream for the engine, and its resident store. */
static int open_model(runner *r, int use_engine, int use_resident) {
  const cli_opts *o = r->o;
  char err[512] = "";
  if (model_make(o, r->backend, r->n_ctx, r->tp, &r->m, err, sizeof err) != 0) {
    say_error("model: %s", err);
    return -1;
  }
  if (use_engine) {
    if (model_stream(r->m) != NULL) {
      /* CUDA backend: a cudaStream_t is an akv_stream (akv_stream_from_cuda). */
      r->stream = (akv_stream)model_stream(r->m);
    } else {
      akv_status st = akv_stream_create(r->engine, &r->stream);
      if (st != AKV_OK) {
        say_error("akv_stream_create: %s (%s)", akv_status_string(st),
                  akv_engine_last_error(r->engine));
        return -1;
      }
      r->own_stream = 1;
    }
    r->n_dense = model_dense_layers(&o->g);
    r->lease = calloc(r->n_dense, sizeof *r->lease);
    r->slot = calloc(r->n_dense, sizeof *r->slot);
    if (r->lease == NULL || r->slot == NULL) {
      say_error("out of host memory");
      return -1;
    }
  }
  if (use_resident && model_resident_reserve(r->m, r->n_ctx, max_tokens(o)) != 0) {
    say_error("%s", model_error(r->m));
    return -1;
  }
  if (model_hybrid(&o->g)) {
    /* Sliding-window layers stay with the model: one lane of rows per run,
     * so the route and its resident reference never share them. */
    r->win_lanes = use_engine && use_resident ? 2 : 1;
    r->res_lane = use_engine ? 1 : 0;
    if (model_window_reserve(r->m, r->win_lanes, r->n_ctx) != 0) {
      say_error("%s", model_error(r->m));
      return -1;
    }
  }
  return 0;
}

/* Releases everything run() made. After a failed step (an open step or a
 * failed transport) quarantine proves the queues drained before destroy. */
static void close_all(runner *r) {
  if (r->engine) {
    akv_engine_info info;
    int dirty = r->step_open;
    if (akv_engine_info_get(r->engine, &info) == AKV_OK) {
      if (info.transport_failed) dirty = 1;
      for (int k = 0; k < AKV_OP_KIND_COUNT; ++k) r->backend_ops += info.backend_ops[k];
    }
    /* CUDA --tp after a rank failed: no closing agreement (nothing aborts
     * an NCCL group's wait from outside, so it would last the timeout) */
    if (r->tp != NULL && r->tp->w->nccl != NULL && tp_aborted(r->tp->w)) dirty = 1;
    if (dirty) {
      akv_quarantine_report qr;
      akv_engine_quarantine(r->engine, &qr);
    }
    if (r->own_stream) akv_stream_destroy(r->engine, r->stream);
    for (uint32_t i = 0; !dirty && i < r->n_ctx; ++i) {
      if (r->group == NULL) akv_context_close(r->ctx[i]);
      else if (akv_group_context_close(r->group, r->ctx[i]) != AKV_OK) {
        /* the group stopped (a peer failed): quarantine drains, then destroy */
        akv_quarantine_report qr;
        akv_engine_quarantine(r->engine, &qr);
        dirty = 1;
      }
    }
    akv_status st = r->group ? group_destroy(r) : akv_engine_destroy(r->engine);
    if (st != AKV_OK) say_error("akv_engine_destroy: %s (%s)", akv_status_string(st), lib_last);
  }
  model_destroy(r->m);
  free(r->lease);
  free(r->slot);
}

/* The header of a --logits-out file; the logits follow, fp32
 * [steps][contexts][vocab], native byte order. */
typedef struct logits_header {
  char magic[8]; /* "AKVLOGT1" */
  uint32_t vocab, contexts, steps, kv_dtype;
  uint64_t seed;
} logits_header;

static void logits_header_fill(const cli_opts *o, uint32_t n_ctx, logits_header *h) {
  memset(h, 0, sizeof *h);
  memcpy(h->magic, "AKVLOGT1", 8);
  h->vocab = o->g.vocab;
  h->contexts = n_ctx;
  h->steps = o->warmup + o->steps;
  h->kv_dtype = (uint32_t)o->kv_dtype;
  h->seed = o->seed;
}

/* Before anything runs: a --logits-ref that cannot be read, is a
 * directory, or is a regular file that does not start with a --logits-out
 * header, is said now instead of after the prefill. Other kinds of file (a fifo) are not opened here:
 * reading them would take bytes the run needs. 0, or -1 with the message
 * printed. The geometry is checked when the run opens the file, once the
 * run's contexts are known (logits_files_open). */
static int logits_ref_precheck(const char *path) {
  struct stat st;
  char magic[8];
  FILE *f;
  int ok;
  if (access(path, R_OK) != 0 || stat(path, &st) != 0) {
    say_error("--logits-ref %s: cannot read (%s)", path, strerror(errno));
    return -1;
  }
  if (S_ISDIR(st.st_mode)) {
    say_error("--logits-ref %s: is a directory, not a --logits-out file", path);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) return 0;
  f = fopen(path, "rb");
  if (f == NULL) {
    say_error("--logits-ref %s: cannot read (%s)", path, strerror(errno));
    return -1;
  }
  ok = fread(magic, sizeof magic, 1, f) == 1 && memcmp(magic, "AKVLOGT1", 8) == 0;
  fclose(f);
  if (!ok) {
    say_error("--logits-ref %s: not a --logits-out file", path);
    return -1;
  }
  return 0;
}

/* Opens the --logits-out and --logits-ref files of a run (either may be
 * unset); a reference must have been written by a run of the same seed,
 * contexts, vocabulary and step count. 0, or -1 with the message printed. */
static int logits_files_open(const cli_opts *o, uint32_t n_ctx, FILE **out, FILE **ref) {
  logits_header h, g;
  logits_header_fill(o, n_ctx, &h);
  *out = *ref = NULL;
  if (o->logits_ref) {
    *ref = fopen(o->logits_ref, "rb");
    if (*ref == NULL || fread(&g, sizeof g, 1, *ref) != 1 || memcmp(g.magic, h.magic, 8) != 0) {
      if (o->tp_rank == 0) /* --tp: every rank reads it; rank 0 speaks */
        say_error("--logits-ref %s: not a --logits-out file", o->logits_ref);
      goto fail;
    }
    if (g.vocab != h.vocab || g.contexts != h.contexts || g.steps != h.steps || g.seed != h.seed) {
      if (o->tp_rank == 0)
        say_error("--logits-ref %s: written for vocab %u, %u contexts, %u steps, seed %llu; "
                  "this run has %u, %u, %u, %llu",
                  o->logits_ref, g.vocab, g.contexts, g.steps, (unsigned long long)g.seed,
                  h.vocab, h.contexts, h.steps, (unsigned long long)h.seed);
      goto fail;
    }
    /* A regular file holds exactly the header's steps: one cut short or
     * with bytes past its last step is refused before the first step, not
     * found at the step where it ends (or never). */
    struct stat sz;
    const uint64_t want = (uint64_t)sizeof g + (uint64_t)g.steps * g.contexts * g.vocab * sizeof(float);
    if (fstat(fileno(*ref), &sz) == 0 && S_ISREG(sz.st_mode) && (uint64_t)sz.st_size != want) {
      if (o->tp_rank == 0)
        say_error("--logits-ref %s: holds %llu bytes, but its header's %u steps of %u contexts "
                  "and vocab %u take %llu",
                  o->logits_ref, (unsigned long long)sz.st_size, g.steps, g.contexts, g.vocab,
                  (unsigned long long)want);
      goto fail;
    }
  }
  if (o->logits_out && *ref != NULL) {
    /* Opening the output truncates it: when it is the reference itself (the
     * same file by device and inode, whatever the spelling of the path) the
     * reference would be emptied before its first step is read. */
    struct stat sr, so;
    if (fstat(fileno(*ref), &sr) == 0 && stat(o->logits_out, &so) == 0 && sr.st_dev == so.st_dev &&
        sr.st_ino == so.st_ino) {
      say_error("--logits-out %s is the --logits-ref file; writing it would empty the reference "
                "before it is read: give another path",
                o->logits_out);
      goto fail;
    }
  }
  if (o->logits_out) {
    *out = fopen(o->logits_out, "wb");
    if (*out == NULL || fwrite(&h, sizeof h, 1, *out) != 1) {
      say_error("--logits-out %s: cannot write (%s)", o->logits_out,
                *out == NULL ? strerror(errno) : "short write");
      goto fail;
    }
  }
  return 0;
fail:
  if (*ref) fclose(*ref);
  if (*out) fclose(*out);
  *out = *ref = NULL;
  return -1;
}

/*
 * warmup + steps decode steps of the route (timed), each followed with
 * --check by the same step on the resident store, whose logits must match bit
 * for bit. Every context continues greedily with the route's argmax.
 */
static int decode_steps(runner *r, int steps_out, run_result *res) {
  const cli_opts *o = r->o;
  const int use_engine = r->engine != NULL;
  const uint32_t total = o->warmup + o->steps, V = o->g.vocab;
  const uint64_t lbytes = (uint64_t)r->n_ctx * V * sizeof(float);
  float *logits = malloc(lbytes), *ref = malloc(lbytes), *other = NULL;
  double *ms = calloc(total, sizeof *ms), *res_ms = calloc(total, sizeof *res_ms);
  double route_s = 0.0, resident_s = 0.0;
  akv_engine_info info0, info1;
  int32_t tok[MODEL_MAX_BATCH];
  FILE *lout = NULL, *lref = NULL;
  int rc = -1;
  memset(&info0, 0, sizeof info0);
  memset(&info1, 0, sizeof info1);
  if (!logits || !ref || !ms || !res_ms) {
    say_error("out of host memory for the logits of %u contexts", r->n_ctx);
    goto out;
  }
  if (logits_files_open(o, r->n_ctx, &lout, &lref) != 0) goto out;
  if (lref && (other = malloc(lbytes)) == NULL) {
    say_error("out of host memory for the reference logits");
    goto out;
  }
  res->ref_compared = lref != NULL;
  for (uint32_t i = 0; i < r->n_ctx; ++i)
    tok[i] = (int32_t)(model_mix64(o->seed ^ (0x746f6b656eull + i)) % V);
  res->checked = use_engine && o->check;
  res->first_mismatch = UINT32_MAX;

  for (uint32_t s = 0; s < total; ++s) {
    const int measured = s >= o->warmup;
    if (s == o->warmup && use_engine) akv_engine_info_get(r->engine, &info0);
    double t0 = now_s();
    r->step_no = s + 1;
    int src = use_engine ? step_engine(r, tok, logits) : step_resident(r, tok, logits);
    double t1 = now_s();
    if (src != 0) {
      say_error("step %u: %s", s + 1, r->err);
      goto out;
    }
    ms[s] = (t1 - t0) * 1e3;
    if (measured) route_s += t1 - t0;
    if (use_engine && o->release_headroom_at > 0 && res->step_ms == NULL)
      res->step_ms = calloc(total, sizeof *res->step_ms);
    if (use_engine && res->step_ms != NULL) {
      res->step_ms[s] = ms[s];
      res->n_step_ms = s + 1;
    }

    int same = -1;
    if (res->checked) {
      double t2 = now_s();
      if (step_resident(r, tok, ref) != 0) {
        say_error("step %u: %s", s + 1, r->err);
        goto out;
      }
      res_ms[s] = (now_s() - t2) * 1e3;
      if (measured) resident_s += res_ms[s] / 1e3;
      same = memcmp(logits, ref, lbytes) == 0;
      res->steps_compared++;
      if (!same) {
        res->mismatched_steps++;
        if (res->first_mismatch == UINT32_MAX) res->first_mismatch = s + 1;
        for (uint64_t k = 0; k < (uint64_t)r->n_ctx * V; ++k) {
          double d = fabs((double)logits[k] - (double)ref[k]);
          if (d > res->max_abs_diff || d != d) res->max_abs_diff = d;
        }
      }
    }
    model_memory mm;
    model_memory_get(r->m, &mm);
    if (mm.device_used > res->device_peak_bytes) res->device_peak_bytes = mm.device_used;

    if (steps_out) {
      printf("step %*u/%u  %-8s %9.2f ms", total >= 100 ? 4 : 2, s + 1, total,
             route_names[o->route], ms[s]);
      if (same >= 0)
        printf("  resident %9.2f ms  %s", res_ms[s], same ? "bitwise ok" : "MISMATCH");
      printf("%s\n", measured ? "" : "  (warm-up)");
      fflush(stdout);
    }
    if (lout && fwrite(logits, lbytes, 1, lout) != 1) {
      say_error("--logits-out %s: write failed", o->logits_out);
      goto out;
    }
    if (lref) {
      /* Distance from the reference run; both continue with its tokens, so
       * every step compares logits of the same inputs. */
      if (fread(other, lbytes, 1, lref) != 1) {
        if (o->tp_rank == 0) say_error("--logits-ref %s: ends before step %u", o->logits_ref, s + 1);
        goto out;
      }
      for (uint64_t k = 0; k < (uint64_t)r->n_ctx * V; ++k) {
        const double d = fabs((double)logits[k] - (double)other[k]);
        if (d > res->ref_max_abs_diff || d != d) res->ref_max_abs_diff = d;
      }
      for (uint32_t i = 0; i < r->n_ctx; ++i) {
        tok[i] = argmax(other + (uint64_t)i * V, V);
        res->ref_top1_agree += argmax(logits + (uint64_t)i * V, V) == tok[i];
        res->ref_top1_total++;
      }
      res->ref_steps++;
    } else {
      for (uint32_t i = 0; i < r->n_ctx; ++i) tok[i] = argmax(logits + (uint64_t)i * V, V);
    }
  }

  res->steps = o->steps;
  res->tokens_per_s = route_s > 0 ? (double)r->n_ctx * o->steps / route_s : 0.0;
  double sum = 0.0;
  for (uint32_t s = o->warmup; s < total; ++s) sum += ms[s];
  res->step_ms_mean = sum / o->steps;
  quantiles(ms + o->warmup, o->steps, &res->step_ms_median, &res->step_ms_p90);
  if (res->checked) {
    double p90;
    res->resident_tokens_per_s = resident_s > 0 ? (double)r->n_ctx * o->steps / resident_s : 0.0;
    quantiles(res_ms + o->warmup, o->steps, &res->resident_step_ms_median, &p90);
  }
  if (use_engine) {
    akv_engine_info_get(r->engine, &info1);
    res->bytes_h2d = (info1.bytes_h2d - info0.bytes_h2d) / o->steps;
    res->bytes_d2d = (info1.bytes_d2d - info0.bytes_d2d) / o->steps;
    res->bytes_d2h = (info1.bytes_d2h - info0.bytes_d2h) / o->steps;
    res->bytes_in_place = (info1.bytes_in_place - info0.bytes_in_place) / o->steps;
    res->engine_device_bytes = info1.device_bytes_allocated;
    /* The engine samples the device at its syncs, the model after every step. */
    if (info1.device_peak_bytes > res->device_peak_bytes)
      res->device_peak_bytes = info1.device_peak_bytes;
    akv_admission_counters(r->engine, res->adm, AKV_ADM_RULE_COUNT);
  }
  rc = 0;
out:
  if (lout && fclose(lout) != 0 && rc == 0) {
    say_error("--logits-out %s: write failed", o->logits_out);
    rc = -1;
  }
  if (lref) fclose(lref);
  free(logits);
  free(ref);
  free(other);
  free(ms);
  free(res_ms);
  return rc;
}

/*
 * One run: o->route over o->contexts prefilled contexts; with --check,
 * resident alongside in the same process. steps_out: print the admission
 * counters and a line per step (human decode). Returns 0 or EXIT_RUN_ERROR
 * (the message printed).
 */
static int run_rank(const cli_opts *o, int steps_out, run_result *res, tp_rank *tp) {
  runner rr, *r = &rr;
  akv_engine_config cfg;
  const int use_engine = o->route != ROUTE_RESIDENT;
  const int use_resident = o->route == ROUTE_RESIDENT || o->check;
  int rc = EXIT_RUN_ERROR;
  memset(r, 0, sizeof *r);
  memset(res, 0, sizeof *res);
  r->o = o;
  r->tp = tp;
  r->backend = resolve_backend(o);
  r->n_ctx = o->contexts;
  res->backend = r->backend;
  res->route = o->route;
  if (fit_config(o, r->backend, &cfg, &res->fit, &res->host_pool_chosen) != 0) return rc;
  res->host_pool_gib = cfg.host_pool_gib;
  res->history_bytes = res->fit.history_bytes;

  if (use_engine && open_engine(r, &cfg, res) != 0) goto out;
  res->contexts = r->n_ctx;
  if (open_model(r, use_engine, use_resident) != 0) goto out;
  if (prefill(r, use_engine, use_resident, &res->prefill_s) != 0) {
    say_error("%s", r->err);
    goto out;
  }
  for (uint32_t i = 0; i < r->n_ctx; ++i) r->res_len[i] = ctx_tokens(o, i);
  if (tp != NULL && tp->w->nccl != NULL && tp_barrier(tp->w) != 0) {
    /* CUDA: every rank is set up before the first all-reduce, so a rank
     * that failed in its setup stops the others here, not on the GPU */
    say_error("rank %u stops: another rank failed before the first step", tp->rank);
    goto out;
  }
  if (use_engine) akv_admission_counters(r->engine, res->adm, AKV_ADM_RULE_COUNT);
  if (steps_out && use_engine) {
    print_counters(res->adm);
    fflush(stdout);
  }
  if (decode_steps(r, steps_out, res) != 0) goto out;
  model_memory_get(r->m, &res->mem);
  if (res->mem.device_used > res->device_peak_bytes) res->device_peak_bytes = res->mem.device_used;
  rc = 0;
out:
  if (rc != 0 && tp != NULL) tp_abort(tp->w); /* the other ranks stop instead of waiting */
  close_all(r);
  /* A --fail-nth past the run's last backend operation injected nothing: the
   * run ended as if it had not been given, which is said (it cannot be known
   * before the run). */
  if (rc == 0 && use_engine && o->fail_nth > 0 && r->backend_ops < o->fail_nth &&
      (tp == NULL || tp->rank == 0))
    fprintf(stderr,
            "activekv: note: --fail-nth %u injected no fault: the engine made %llu backend "
            "operations in this run (choose N in 1..%llu)\n",
            o->fail_nth, (unsigned long long)r->backend_ops, (unsigned long long)r->backend_ops);
  if (rc != 0) run_result_free(res); /* a failed run reports nothing */
  return rc;
}

static int run(const cli_opts *o, int steps_out, run_result *res) {
  return run_rank(o, steps_out, res, NULL);
}

/* --tp: one rank's thread. */
typedef struct tp_job {
  cli_opts o; /* the rank's copy: its shard geometry */
  tp_rank t;
  int steps_out;
  run_result res;
  int rc;
} tp_job;

static void *tp_thread(void *arg) {
  tp_job *j = arg;
  j->rc = run_rank(&j->o, j->steps_out, &j->res, &j->t);
  tp_world *w = j->t.w;
  pthread_mutex_lock(&w->mu);
  w->finished++;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

/*
 * Waits for the `started` rank threads to return. Once a rank failed
 * (the world aborted), the others get TP_GRACE_S to end: a rank waiting at
 * an agreement point ends by the group's timeout, but on the CUDA backend a
 * rank whose stream is inside the model's all-reduce waits on the GPU for
 * the failed rank, and nothing on the host can end that wait. Returns 1
 * when every thread returned, 0 when some did not within the grace.
 */
static int tp_wait(tp_world *w, uint32_t started) {
  struct timespec dl;
  int have_dl = 0, all;
  pthread_mutex_lock(&w->mu);
  while (w->finished < started) {
    if (w->aborted && !have_dl) {
      clock_gettime(CLOCK_REALTIME, &dl);
      dl.tv_sec += TP_GRACE_S;
      have_dl = 1;
    }
    if (!have_dl) pthread_cond_wait(&w->cv, &w->mu);
    else if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT) break;
  }
  all = w->finished >= started;
  pthread_mutex_unlock(&w->mu);
  return all;
}

/* The rank's options: the shard of o's model that rank `rank` of o->tp holds. */
static void tp_rank_opts(const cli_opts *o, uint32_t rank, cli_opts *out) {
  *out = *o;
  out->full_g = o->g;
  out->tp_rank = rank;
  out->g.n_heads = o->g.n_heads / o->tp;
  out->g.kv_heads = o->g.kv_heads / o->tp;
  out->g.ffn = o->g.ffn / o->tp;
  /* CUDA: rank r on GPU r (its engine's device_ordinal, its model's device) */
  if (resolve_backend(o) == AKV_BACKEND_CUDA) out->device = (int)rank;
  if (rank > 0) { /* rank 0 reports; the others stay quiet */
    out->progress = 0;
    out->logits_out = NULL;
    /* --logits-ref stays: every rank reads the reference and feeds its
     * argmax as the next tokens, so that all shards decode the same
     * tokens (rank 0 alone following it made the ranks' inputs differ
     * wherever the reference's argmax was not the run's own). */
  }
}

/*
 * --tp N: N ranks in this process, one thread each (one process drives
 * every rank so that --check compares against the TP=N resident run in the
 * same process). Host backend: the ranks' groups on one in-process world.
 * CUDA backend: rank r on GPU r, the groups and the model's all-reduce on
 * NCCL communicators made here by ncclCommInitAll (tp_nccl.h). Rank 0's
 * result is the report's, with every rank's bytes.
 */
static int run_tp(const cli_opts *o, int steps_out, run_result *res) {
  const uint32_t n = o->tp;
  tp_world w;
  tp_job *jobs = calloc(n, sizeof *jobs);
  pthread_t th[TP_MAX];
  uint32_t started = 0;
  int rc = EXIT_RUN_ERROR;
  memset(res, 0, sizeof *res);
  memset(&w, 0, sizeof w);
  w.n = n;
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  if (jobs == NULL) {
    say_error("out of host memory");
    goto out;
  }
  const int cuda = resolve_backend(o) == AKV_BACKEND_CUDA;
  if (cuda) {
#ifdef ACTIVEKV_NCCL
    char err[512];
    if (tp_nccl_create(n, &w.nccl, err, sizeof err) != 0) {
      say_error("--tp %u: %s", n, err);
      goto out;
    }
#else
    say_error("--tp %u: this activekv was built without NCCL", n); /* cmd_decode refused it */
    goto out;
#endif
  } else {
    akv_status st = akv_group_world_create(n, o->contexts, &w.gw);
    if (st != AKV_OK) {
      say_error("akv_group_world_create: %s", akv_status_string(st));
      goto out;
    }
  }
  for (uint32_t k = 0; k < n; ++k) {
    tp_job *j = &jobs[k];
    tp_rank_opts(o, k, &j->o);
    j->t.w = &w;
    j->t.rank = k;
    j->steps_out = k == 0 ? steps_out : 0;
    if (cuda) continue; /* the all-reduce is NCCL's, on the device */
    j->t.cap = (uint64_t)o->contexts * o->g.hidden;
    j->t.sum = malloc(j->t.cap * sizeof(float));
    if (j->t.sum == NULL) {
      say_error("out of host memory");
      goto out;
    }
  }
  for (; started < n; ++started) {
    if (pthread_create(&th[started], NULL, tp_thread, &jobs[started]) != 0) {
      say_error("--tp %u: could not start rank %u's thread", n, started);
      tp_abort(&w);
      break;
    }
  }
  int failed = started < n;
  if (cuda && !tp_wait(&w, started)) {
    /* A rank failed and another is still blocked, its stream inside the
     * model's all-reduce waiting for the failed rank: nothing on the host
     * ends that wait, so the process ends (the driver frees the GPUs). */
    say_error("--tp %u: a rank failed and another is still blocked %u s later (its GPU waits "
              "in the model's NCCL all-reduce for the failed rank); exiting without cleanup",
              n, TP_GRACE_S);
    fflush(stdout);
    fflush(stderr);
    _exit(EXIT_RUN_ERROR);
  }
  for (uint32_t k = 0; k < started; ++k) {
    pthread_join(th[k], NULL);
    failed |= jobs[k].rc != 0;
  }
  if (failed) goto out;
  *res = jobs[0].res;
  jobs[0].res.step_ms = NULL; /* moved into *res: the caller frees it */
  res->tp = n;
  res->tp_nccl = cuda;
  for (uint32_t k = 0; k < n; ++k) {
    const run_result *x = &jobs[k].res;
    res->rank_h2d[k] = x->bytes_h2d;
    res->rank_d2d[k] = x->bytes_d2d;
    res->rank_d2h[k] = x->bytes_d2h;
    if (x->mismatched_steps > res->mismatched_steps) {
      res->mismatched_steps = x->mismatched_steps;
      res->first_mismatch = x->first_mismatch;
    }
    if (x->max_abs_diff > res->max_abs_diff) res->max_abs_diff = x->max_abs_diff;
  }
  rc = 0;
out:
  for (uint32_t k = 0; jobs && k < n; ++k) {
    free(jobs[k].t.sum);
    run_result_free(&jobs[k].res); /* rank 0's, when it reports, was moved out above */
  }
  free(jobs);
  if (w.gw) akv_group_world_destroy(w.gw);
#ifdef ACTIVEKV_NCCL
  tp_nccl_destroy(w.nccl, rc == 0);
#endif
  pthread_cond_destroy(&w.cv);
  pthread_mutex_destroy(&w.mu);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Reports                                                                   */
/* ------------------------------------------------------------------------ */

static void print_geometry(const cli_opts *o) {
  const model_geometry *g = &o->g;
  char layers[128], params[32];
  if (model_hybrid(g))
    snprintf(layers, sizeof layers,
             "%u layers (%u dense, staged; %u sliding-window of %u tokens, resident)", g->n_layers,
             model_dense_layers(g), model_window_layers(g), g->window);
  else
    snprintf(layers, sizeof layers, "%u layers", g->n_layers);
  if (o->preset_defaulted)
    printf("note: no --preset and the host backend, so the preset is tiny (llama3.2-1b, the "
           "CUDA default, is beyond the CPU model); pass --preset to choose\n");
  printf("model: %s geometry, %s, %u q heads, %u kv heads, head_dim %u, hidden %u, "
         "ffn %u, vocab %u (%s parameters, random weights, seed %llu)\n",
         o->preset, layers, g->n_heads, g->kv_heads, g->head_dim, g->hidden, g->ffn, g->vocab,
         fmt_params(params, sizeof params, model_param_count(g)), (unsigned long long)o->seed);
}

static void print_tokens(FILE *f, const cli_opts *o, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) fprintf(f, "%s%u", i ? "," : "", ctx_tokens(o, i));
}

/*
 * The lines under the library's fit line: where its token count comes from
 * (the fit counts every row a context will hold, not only --tokens), which
 * host pool was chosen, and whether that pool exceeds this machine's memory
 * (a pool is never sized from memory, DESIGN §3, but one that cannot be
 * pinned here is said so before anything is allocated).
 */
static void print_fit_notes(const cli_opts *o, uint32_t pool_gib, int pool_chosen) {
  char a[32];
  printf("fit: %u rows per context = %s--tokens %u + --warmup %u + --steps %u (every decoded "
         "step appends a row)\n",
         max_tokens(o), o->n_tokens > 1 ? "the longest " : "", max_history(o), o->warmup,
         o->steps);
  if (pool_chosen)
    printf("fit: host pool %u GiB is the smallest that holds --contexts (set --host-pool-gib "
           "to choose)\n",
           pool_gib);
  const uint64_t mem = machine_memory_bytes();
  if (mem > 0 && (uint64_t)pool_gib * GIB > mem)
    printf("fit: warning: the %u GiB host pool%s is more than this machine's %s of memory and "
           "cannot be pinned here; lower --contexts or --tokens, or run on a larger machine\n",
           pool_gib, pool_chosen ? " it needs" : " (--host-pool-gib)",
           fmt_mem(a, sizeof a, mem));
  else if (mem == 0)
    printf("fit: this machine's memory could not be read; the %u GiB host pool is unchecked "
           "against it\n",
           pool_gib);
}

static void print_fit(const cli_opts *o, const run_result *res) {
  printf("fit: %s\n", res->fit.line);
  print_fit_notes(o, res->host_pool_gib, res->host_pool_chosen);
}

/* PCIe bound of the staged bytes: ms per step and tokens/s. */
static void pcie_bound(const cli_opts *o, const run_result *res, double *ms, double *tps) {
  uint64_t bytes = res->bytes_h2d;
  /* --tp: every rank stages its shard over its own link at once; the step
   * waits for the rank with the most bytes. */
  for (uint32_t k = 0; k < res->tp; ++k)
    if (res->rank_h2d[k] > bytes) bytes = res->rank_h2d[k];
  *ms = bytes / (o->pcie_gbps * 1e9) * 1e3;
  *tps = *ms > 0 ? res->contexts / (*ms / 1e3) : 0.0;
}

static void print_summary(const cli_opts *o, const run_result *res) {
  char a[32], b[32], c[32], d[32];
  double bound_ms, bound_tps;
  pcie_bound(o, res, &bound_ms, &bound_tps);
  printf("\nsummary (%u measured steps, %u contexts, %s backend)\n", res->steps, res->contexts,
         backend_name(res->backend));
  printf("  %-20s %s\n", "route", route_names[res->route]);
  if (res->tp > 0) {
    printf("  %-20s %u ranks, %s; H2D per rank per step:", "tensor parallel", res->tp,
           res->tp_nccl ? "one GPU each, NCCL group" : "in-process group");
    for (uint32_t k = 0; k < res->tp; ++k)
      printf("%s %s", k ? "," : "", fmt_xfer(a, sizeof a, res->rank_h2d[k]));
    printf(" (each over its own link; the bound below is per rank)\n");
  }
  printf("  %-20s %s\n", "K/V dtype",
         o->kv_dtype == AKV_DTYPE_FP8_E4M3 ? "fp8 (E4M3, fixed per-head scales)" : "bf16");
  printf("  %-20s %.2f", "tokens/s", res->tokens_per_s);
  if (res->checked) printf("   (resident %.2f)", res->resident_tokens_per_s);
  printf("\n  %-20s median %.2f, p90 %.2f", "step ms", res->step_ms_median, res->step_ms_p90);
  if (res->checked) printf("   (resident median %.2f)", res->resident_step_ms_median);
  printf("\n");
  if (res->have_engine && (res->headroom_pages > 0 || o->headroom_gib > 0))
    printf("  %-20s %u pages (%s) of up to %u GiB\n", "headroom", res->headroom_pages,
           fmt_mem(a, sizeof a, res->headroom_bytes), o->headroom_gib);
  if (res->release_step > 0)
    printf("  %-20s step %u: %s given back; call %.3f ms, request to reusable %.3f ms\n",
           "headroom release", res->release_step, fmt_mem(a, sizeof a, res->released_bytes),
           res->release_call_ms, res->release_reusable_ms);
  if (res->have_engine)
    printf("  %-20s engine %s (staging %s, %u pages), process peak %s\n", "device peak",
           fmt_mem(a, sizeof a, res->engine_device_bytes),
           fmt_mem(b, sizeof b, res->engine_staging_bytes), res->device_pages,
           res->device_peak_bytes ? fmt_mem(c, sizeof c, res->device_peak_bytes) : "unknown");
  else
    printf("  %-20s engine none, process peak %s\n", "device peak",
           res->device_peak_bytes ? fmt_mem(c, sizeof c, res->device_peak_bytes) : "n/a (host)");
  printf("  %-20s weights %s, resident K/V %s, scratch %s", "model",
         fmt_mem(a, sizeof a, res->mem.weights), fmt_mem(b, sizeof b, res->mem.resident),
         fmt_mem(d, sizeof d, res->mem.scratch));
  if (res->mem.window)
    printf(", sliding-window rows %s", fmt_mem(a, sizeof a, res->mem.window));
  printf("\n");
  if (res->have_engine) {
    printf("  %-20s %s pinned, %s of history per context\n", "host pool",
           fmt_mem(a, sizeof a, res->host_pool_bytes), fmt_mem(b, sizeof b, res->history_bytes));
    printf("  %-20s H2D %s, D2D %s, D2H %s", res->tp > 0 ? "bytes per step, r0" : "bytes per step", fmt_xfer(a, sizeof a, res->bytes_h2d),
           fmt_xfer(b, sizeof b, res->bytes_d2d), fmt_xfer(c, sizeof c, res->bytes_d2h));
    if (res->route == ROUTE_PAGED)
      printf("; read in place %s", fmt_xfer(a, sizeof a, res->bytes_in_place));
    printf("\n");
    if (bound_ms > 0)
      printf("  %-20s %.3g ms per step at %.1f GB/s = %.2f tokens/s; achieved %.1f%% of it\n",
             "PCIe bound", bound_ms, o->pcie_gbps, bound_tps,
             100.0 * bound_ms / res->step_ms_median);
    else
      printf("  %-20s none: nothing crossed PCIe host-to-device\n", "PCIe bound");
    if (res->checked && res->step_ms_median > 0) {
      /* A step can beat neither the bytes it staged nor resident attention. */
      const double floor_ms =
          bound_ms > res->resident_step_ms_median ? bound_ms : res->resident_step_ms_median;
      printf("  %-20s max(resident %.3g ms, PCIe bound %.3g ms) / measured %.3g ms = %.3f%s\n",
             "target ratio", res->resident_step_ms_median, bound_ms, res->step_ms_median,
             floor_ms / res->step_ms_median,
             floor_ms / res->step_ms_median >= 1.0 / 1.10 ? " (within 1.10x)" : " (over 1.10x)");
    }
    printf("  ");
    print_counters(res->adm);
  }
  if (res->checked) {
    if (res->mismatched_steps == 0)
      printf("  %-20s identical: %u of %u steps' logits match resident bit for bit\n", "bitwise",
             res->steps_compared, res->steps_compared);
    else
      printf("  %-20s MISMATCH: %u of %u steps differ from resident (first: step %u, max |diff| "
             "%.3g)\n",
             "bitwise", res->mismatched_steps, res->steps_compared, res->first_mismatch,
             res->max_abs_diff);
  } else if (res->route != ROUTE_RESIDENT) {
    printf("  %-20s not checked (pass --check)\n", "bitwise");
  }
  if (res->ref_compared)
    printf("  %-20s max |logit diff| %.4g, top-1 agreement %u of %u (%.1f%%) over %u steps "
           "(inputs: the reference's tokens)\n",
           "vs --logits-ref", res->ref_max_abs_diff, res->ref_top1_agree, res->ref_top1_total,
           res->ref_top1_total ? 100.0 * res->ref_top1_agree / res->ref_top1_total : 0.0,
           res->ref_steps);
  if (res->queued)
    printf("  %-20s %u contexts did not fit the host pool (shrink mode) and were not run\n",
           "queued", res->queued);
}

/* A JSON number: JSON has no NaN or infinity, and printf's "nan" and "inf"
 * made the object unparsable (a --logits-ref holding a NaN logit gave
 * "max_abs_diff":nan); a value that is not finite is null. */
typedef struct jnum_text {
  char s[32];
} jnum_text;
static jnum_text jnum(double v) {
  jnum_text t;
  if (isfinite(v)) snprintf(t.s, sizeof t.s, "%.6g", v);
  else snprintf(t.s, sizeof t.s, "null");
  return t;
}

static void print_json(const cli_opts *o, const char *cmd, const run_result *res) {
  double bound_ms, bound_tps;
  pcie_bound(o, res, &bound_ms, &bound_tps);
  const model_geometry *g = &o->g;
  printf("{\"cmd\":\"%s\",\"version\":\"%s\",\"preset\":\"%s\",", cmd, akv_version_string(),
         o->preset);
  printf("\"geometry\":{\"layers\":%u,\"dense_layers\":%u,\"window\":%u,\"dense_every\":%u,"
         "\"heads\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"hidden\":%u,\"ffn\":%u,\"vocab\":%u},",
         g->n_layers, model_dense_layers(g), model_hybrid(g) ? g->window : 0,
         model_hybrid(g) ? g->dense_every : 1, g->n_heads, g->kv_heads, g->head_dim, g->hidden,
         g->ffn, g->vocab);
  printf("\"seed\":%llu,\"backend\":\"%s\",\"route\":\"%s\",\"contexts\":%u,\"queued\":%u,"
         "\"tokens\":[",
         (unsigned long long)o->seed, backend_name(res->backend), route_names[res->route],
         res->contexts, res->queued);
  print_tokens(stdout, o, res->contexts);
  printf("],\"steps\":%u,\"warmup\":%u,\"page_tokens\":%u,\"chunk_tokens\":%u,", o->steps,
         o->warmup, o->page_tokens, chunk_tokens(o));
  printf("\"kv_dtype\":\"%s\",", o->kv_dtype == AKV_DTYPE_FP8_E4M3 ? "fp8" : "bf16");
  printf("\"tp\":%u,", res->tp > 0 ? res->tp : 1);
  if (res->tp > 0) {
    const char *const keys[3] = {"rank_bytes_h2d_per_step", "rank_bytes_d2d_per_step",
                                 "rank_bytes_d2h_per_step"};
    const uint64_t *vals[3] = {res->rank_h2d, res->rank_d2d, res->rank_d2h};
    for (int q = 0; q < 3; ++q) {
      printf("\"%s\":[", keys[q]);
      for (uint32_t k = 0; k < res->tp; ++k)
        printf("%s%llu", k ? "," : "", (unsigned long long)vals[q][k]);
      printf("],");
    }
  }
  if (res->ref_compared)
    printf("\"vs_ref\":{\"steps\":%u,\"max_abs_diff\":%s,\"top1_agree\":%u,\"top1_total\":%u},",
           res->ref_steps, jnum(res->ref_max_abs_diff).s, res->ref_top1_agree, res->ref_top1_total);
  printf("\"host_pool_gib\":%u,\"device_pool_gib\":%u,\"target_pages\":", res->host_pool_gib,
         route_retains(res->route) ? o->device_pool_gib : 0);
  if (o->target_pages == AKV_TARGET_FAIR_SHARE) printf("\"fair\"");
  else printf("%u", o->target_pages);
  printf(",\"burst_pages\":%u,\"history_bytes\":%llu,\"effective_concurrency\":%u,", o->burst_pages,
         (unsigned long long)res->fit.history_bytes, res->fit.effective_concurrency);
  printf("\"tokens_per_s\":%s,\"step_ms_median\":%s,\"step_ms_p90\":%s,"
         "\"step_ms_mean\":%s,\"prefill_s\":%s,",
         jnum(res->tokens_per_s).s, jnum(res->step_ms_median).s, jnum(res->step_ms_p90).s,
         jnum(res->step_ms_mean).s, jnum(res->prefill_s).s);
  printf("\"device_engine_bytes\":%llu,\"device_staging_bytes\":%llu,\"device_pages\":%u,"
         "\"device_peak_bytes\":%llu,",
         (unsigned long long)res->engine_device_bytes,
         (unsigned long long)res->engine_staging_bytes, res->device_pages,
         (unsigned long long)res->device_peak_bytes);
  printf("\"model_weight_bytes\":%llu,\"model_resident_bytes\":%llu,"
         "\"model_window_bytes\":%llu,\"host_pool_bytes\":%llu,",
         (unsigned long long)res->mem.weights, (unsigned long long)res->mem.resident,
         (unsigned long long)res->mem.window, (unsigned long long)res->host_pool_bytes);
  printf("\"bytes_in_place_per_step\":%llu,", (unsigned long long)res->bytes_in_place);
  printf("\"headroom_gib\":%u,\"headroom_reserve_gib\":%u,\"headroom_pages\":%u,"
         "\"headroom_bytes\":%llu,",
         o->headroom_gib, o->headroom_reserve_gib, res->headroom_pages,
         (unsigned long long)res->headroom_bytes);
  if (res->release_step > 0) {
    printf("\"headroom_release\":{\"step\":%u,\"bytes\":%llu,\"call_ms\":%s,"
           "\"request_to_reusable_ms\":%s},",
           res->release_step, (unsigned long long)res->released_bytes,
           jnum(res->release_call_ms).s, jnum(res->release_reusable_ms).s);
  }
  if (res->step_ms != NULL) {
    printf("\"step_ms\":[");
    for (uint32_t k = 0; k < res->n_step_ms; ++k) printf("%s%s", k ? "," : "", jnum(res->step_ms[k]).s);
    printf("],");
  }
  printf("\"bytes_h2d_per_step\":%llu,\"bytes_d2d_per_step\":%llu,\"bytes_d2h_per_step\":%llu,",
         (unsigned long long)res->bytes_h2d, (unsigned long long)res->bytes_d2d,
         (unsigned long long)res->bytes_d2h);
  printf("\"pcie_gbps\":%s,\"pcie_bound_ms\":%s,\"pcie_bound_tokens_per_s\":%s,"
         "\"pcie_ratio\":%s,",
         jnum(o->pcie_gbps).s, jnum(bound_ms).s, jnum(bound_tps).s,
         jnum(bound_ms > 0 ? bound_ms / res->step_ms_median : 0.0).s);
  printf("\"admission\":{");
  for (int k = 0; k < AKV_ADM_RULE_COUNT; ++k)
    printf("%s\"%s\":%llu", k ? "," : "", akv_adm_rule_string((akv_adm_rule)k),
           (unsigned long long)res->adm[k]);
  printf("},\"check\":%s", res->checked ? "true" : "false");
  if (res->checked)
    printf(",\"bitwise\":%s,\"steps_compared\":%u,\"mismatched_steps\":%u,"
           "\"resident_tokens_per_s\":%s,\"resident_step_ms_median\":%s,"
           "\"target_ratio\":%s",
           res->mismatched_steps == 0 ? "true" : "false", res->steps_compared,
           res->mismatched_steps, jnum(res->resident_tokens_per_s).s,
           jnum(res->resident_step_ms_median).s,
           jnum(res->step_ms_median > 0
                    ? (bound_ms > res->resident_step_ms_median ? bound_ms
                                                               : res->resident_step_ms_median) /
                          res->step_ms_median
                    : 0.0).s);
  else
    printf(",\"bitwise\":null");
  printf("}\n");
  fflush(stdout);
}

/* ------------------------------------------------------------------------ */
/* Subcommands                                                               */
/* ------------------------------------------------------------------------ */

static int cmd_fit(const cli_opts *o) {
  akv_engine_config cfg;
  akv_fit_report r;
  int chosen;
  if (fit_config(o, resolve_backend(o), &cfg, &r, &chosen) != 0) return EXIT_USAGE;
  if (o->json) {
    printf("{\"cmd\":\"fit\",\"preset\":\"%s\",\"fit_mode\":\"%s\",\"contexts\":%u,"
           "\"tokens\":%u,\"warmup\":%u,\"steps\":%u,\"host_pool_chosen\":%s,"
           "\"machine_memory_bytes\":%llu,\"max_tokens\":%u,"
           "\"row_bytes\":%llu,\"history_bytes\":%llu,\"host_pool_gib\":%u,"
           "\"host_pool_bytes\":%llu,\"fits\":%llu,\"effective_concurrency\":%u,\"ok\":%s,"
           "\"host_pool_gib_needed\":%u,\"page_bytes\":%llu,\"device_pages\":%llu}\n",
           o->preset, o->fit_mode == AKV_FIT_SHRINK ? "shrink" : "refuse", o->contexts,
           max_history(o), o->warmup, o->steps, chosen ? "true" : "false",
           (unsigned long long)machine_memory_bytes(), cfg.max_tokens, (unsigned long long)r.row_bytes,
           (unsigned long long)r.history_bytes, cfg.host_pool_gib,
           (unsigned long long)r.host_pool_bytes, (unsigned long long)r.fits,
           r.effective_concurrency, r.ok ? "true" : "false", r.host_pool_gib_needed,
           (unsigned long long)r.page_bytes, (unsigned long long)r.device_pages);
  } else {
    char a[32], b[32];
    print_geometry(o);
    printf("fit: %s\n", r.line);
    print_fit_notes(o, cfg.host_pool_gib, chosen);
    if (cfg.device_pool_gib > 0)
      printf("device pool: %u GiB = %llu pages of %s (%u tokens of every layer)\n",
             cfg.device_pool_gib, (unsigned long long)r.device_pages,
             fmt_mem(a, sizeof a, r.page_bytes), o->page_tokens);
    if (r.ok)
      printf("verdict: fits - %u of %u contexts, %s of history each\n", r.effective_concurrency,
             o->contexts, fmt_mem(b, sizeof b, r.history_bytes));
    else if (o->fit_mode == AKV_FIT_SHRINK)
      printf("verdict: shrink - concurrency lowered to %u of %u; the rest queue (raise "
             "--host-pool-gib to %u to run all)\n",
             r.effective_concurrency, o->contexts, r.host_pool_gib_needed);
    else
      printf("verdict: does not fit - %llu of %u contexts; raise --host-pool-gib to %u or lower "
             "--contexts to %llu\n",
             (unsigned long long)r.fits, o->contexts, r.host_pool_gib_needed,
             (unsigned long long)r.fits);
  }
  return r.ok ? 0 : EXIT_NO_FIT;
}

/*
 * What the model of this run's backend can take, checked before anything is
 * printed or allocated so that a bad flag is named with exit 2 rather than
 * surfacing as the model's runtime error (exit 1).
 */
static int check_model(const cli_opts *o, akv_backend_kind backend) {
  const model_geometry *g = &o->g;
  char a[32], b[32];
  if (backend == AKV_BACKEND_CUDA) {
    if (g->head_dim != 64 && g->head_dim != 128 && g->head_dim != 256) {
      say_error("--head-dim %u: the CUDA attention kernels take 64, 128 or 256", g->head_dim);
      return EXIT_USAGE;
    }
    return 0;
  }
  if (g->head_dim > AKV_ATTENTION_MAX_HEAD_DIM) {
    say_error("--head-dim %u: the host backend's reference attention takes at most %u "
              "(a multiple of 8)",
              g->head_dim, AKV_ATTENTION_MAX_HEAD_DIM);
    return EXIT_USAGE;
  }
  if (model_param_count(g) > MODEL_CPU_MAX_PARAMS) {
    say_error("the %s geometry has %s parameters, more than the %s the host backend's CPU "
              "model holds; use --preset tiny, shrink --layers/--hidden/--ffn/--vocab, or "
              "--backend cuda on a GPU machine",
              o->preset, fmt_params(a, sizeof a, model_param_count(g)),
              fmt_params(b, sizeof b, MODEL_CPU_MAX_PARAMS));
    return EXIT_USAGE;
  }
  return 0;
}

/*
 * --tp N on the CUDA backend: one process, rank r on GPU r, so N GPUs must
 * be visible; the groups and the model's all-reduce need NCCL, found at
 * build time. 0, or EXIT_USAGE with the message printed.
 */
static int check_tp_cuda(const cli_opts *o) {
#if !defined(ACTIVEKV_CUDA_MODEL)
  say_error("--tp %u: this activekv was built without CUDA; use --backend host", o->tp);
  return EXIT_USAGE;
#elif !defined(ACTIVEKV_NCCL)
  say_error("--tp %u on the CUDA backend needs NCCL, which was not found when this activekv "
            "was built (CMake looks for nccl.h and libnccl next to the CUDA toolkit; see "
            "AKV_WITH_NCCL); use --backend host",
            o->tp);
  return EXIT_USAGE;
#else
  char why[256] = "";
  const int visible = model_cuda_device_count(why, sizeof why);
  if (visible == 0) {
    say_error("--tp %u: the CUDA backend runs one rank per GPU (rank r on GPU r) and 0 GPUs are "
              "visible%s%s%s; use --backend host",
              o->tp, why[0] ? " (" : "", why, why[0] ? ")" : "");
    return EXIT_USAGE;
  }
  if ((int)o->tp > visible) {
    say_error("--tp %u: the CUDA backend runs one rank per GPU (rank r on GPU r) and %d GPU%s "
              "visible; lower --tp to %d or less, or use --backend host",
              o->tp, visible, visible == 1 ? " is" : "s are", visible);
    return EXIT_USAGE;
  }
  if (o->device != 0) {
    say_error("--device %d with --tp %u: rank r runs on GPU r (0..%u); choose the GPUs with "
              "CUDA_VISIBLE_DEVICES instead",
              o->device, o->tp, o->tp - 1);
    return EXIT_USAGE;
  }
  return 0;
#endif
}

static int cmd_decode(const cli_opts *o) {
  run_result res;
  cli_opts rank0; /* --tp: rank 0's shard, for the fit line */
  if (o->route == ROUTE_RESIDENT && o->check) {
    say_error("--check compares a staged route with resident; pass --route stage, arena or paged");
    return EXIT_USAGE;
  }
  int rc = check_model(o, resolve_backend(o));
  if (rc != 0) return rc;
  if (o->tp > 0 && o->route == ROUTE_RESIDENT) {
    say_error("--tp %u: pass a staged route (--route stage, arena or paged); --check adds the "
              "TP=%u resident run",
              o->tp, o->tp);
    return EXIT_USAGE;
  }
  /* A group refuses headroom (akv_group_create_inproc: AKV_ERR_NOT_SUPPORTED,
   * each rank's device would measure its own): said here, as a usage error,
   * instead of a create failure that blamed the backend. */
  if (o->tp > 0 && (o->headroom_gib > 0 || o->release_headroom_at > 0)) {
    say_error("--tp %u: --headroom-gib and --release-headroom-at are not supported with tensor "
              "parallel ranks (a group refuses headroom); drop --tp or the headroom flags",
              o->tp);
    return EXIT_USAGE;
  }
  /* Releasing headroom the engine does not have is refused by the library
   * (AKV_ERR_NOT_SUPPORTED) in the middle of step N, after the warm-up ran:
   * a usage error, said before anything runs. */
  if (o->release_headroom_at > 0 && o->headroom_gib == 0) {
    say_error("--release-headroom-at %u: there is no headroom to give back; pass --headroom-gib N "
              "too", o->release_headroom_at);
    return EXIT_USAGE;
  }
  /* A step the run never reaches would release nothing, and the run would
   * end as if the flag had not been given. */
  if (o->release_headroom_at > (uint64_t)o->warmup + o->steps) {
    say_error("--release-headroom-at %u: the run has %u steps (--warmup %u + --steps %u); "
              "choose a step in 1..%u",
              o->release_headroom_at, o->warmup + o->steps, o->warmup, o->steps,
              o->warmup + o->steps);
    return EXIT_USAGE;
  }
  if (o->tp > 0 && resolve_backend(o) != AKV_BACKEND_HOST) {
    rc = check_tp_cuda(o);
    if (rc != 0) return rc;
  }
  /* The prefill writes every context's history into the host pool: more
   * than this machine's memory cannot be held (the host backend's pool is
   * committed as it is written, so such a run ran on, with no word under
   * --json, until the system killed it). fit only warns: it allocates
   * nothing. */
  const uint64_t mem = machine_memory_bytes();
  if (o->route != ROUTE_RESIDENT && mem > 0) {
    const uint64_t row = model_sat_mul(model_sat_mul(model_dense_layers(&o->g), o->g.kv_heads),
                                       model_sat_mul(o->g.head_dim,
                                                     2u * (uint64_t)model_kv_elem_bytes(o->kv_dtype)));
    uint64_t need = 0;
    for (uint32_t i = 0; i < o->contexts; ++i) {
      const uint64_t h = model_sat_mul(row, (uint64_t)ctx_tokens(o, i) + o->warmup + o->steps);
      need = need > UINT64_MAX - h ? UINT64_MAX : need + h;
    }
    if (o->host_pool_gib > 0 && need > (uint64_t)o->host_pool_gib * GIB)
      need = (uint64_t)o->host_pool_gib * GIB; /* the pool holds what fits; the rest queue or are refused */
    if (need > mem) {
      char a[32], b[32];
      say_error("the %u contexts' histories (--tokens plus --warmup plus --steps rows of every "
                "dense layer) need %s of host memory, more than this machine's %s; lower "
                "--contexts or --tokens, or run on a larger machine",
                o->contexts, fmt_mem(a, sizeof a, need), fmt_mem(b, sizeof b, mem));
      return EXIT_RUN_ERROR;
    }
  }
  if (o->tp > 0) {
    tp_rank_opts(o, 0, &rank0);
  }
  const cli_opts *fo = o->tp > 0 ? &rank0 : o;
  if (o->json) {
    /* The same fit as the report's, unprinted: a usage error found there
     * (a --page-tokens longer than a context) exited 2 in the report and 1
     * under --json, where only the run found it. */
    akv_engine_config cfg;
    akv_fit_report fr;
    int chosen;
    if (fit_config(fo, resolve_backend(o), &cfg, &fr, &chosen) != 0) return EXIT_USAGE;
  } else {
    print_geometry(o);
    printf("run: route %s, %u contexts x ", route_names[o->route], o->contexts);
    print_tokens(stdout, o, o->contexts < o->n_tokens ? o->contexts : o->n_tokens);
    printf(" tokens, %u steps after %u warm-up, page %u tokens, chunk %u, device pool %u GiB%s\n",
           o->steps, o->warmup, o->page_tokens, chunk_tokens(o),
           route_retains(o->route) ? o->device_pool_gib : 0, o->check ? ", checked" : "");
    /* The fit line comes before any allocation, as the engine logs it. */
    akv_engine_config cfg;
    run_result pre;
    memset(&pre, 0, sizeof pre);
    if (fit_config(fo, resolve_backend(o), &cfg, &pre.fit, &pre.host_pool_chosen) != 0)
      return EXIT_USAGE;
    pre.host_pool_gib = cfg.host_pool_gib;
    if (o->tp > 0)
      printf("tp: %u ranks (one thread and one engine each, one group%s), each %u of %u kv "
             "heads, %u of %u heads, ffn %u of %u; fit per rank:\n",
             o->tp,
             resolve_backend(o) == AKV_BACKEND_CUDA ? "; rank r on GPU r, agreement and "
                                                      "all-reduce through NCCL"
                                                    : "",
             fo->g.kv_heads, o->g.kv_heads, fo->g.n_heads, o->g.n_heads, fo->g.ffn, o->g.ffn);
    if (o->route == ROUTE_RESIDENT)
      printf("fit: resident route, no engine: every row stays on the device\n");
    else
      print_fit(fo, &pre);
    fflush(stdout);
  }
  if ((o->tp > 0 ? run_tp(o, !o->json, &res) : run(o, !o->json, &res)) != 0)
    return EXIT_RUN_ERROR;
  if (o->json) print_json(o, "decode", &res);
  else print_summary(o, &res);
  run_result_free(&res);
  return res.checked && res.mismatched_steps ? EXIT_MISMATCH : 0;
}

static int cmd_demo(const cli_opts *base) {
  /* The demo geometry, contexts across page boundaries (255 crosses 256 at
   * its first step, 318 crosses 320 at its third), host backend. */
  cli_opts o = *base;
  o.preset_defaulted = 0; /* the demo picks its own geometry, below */
  /* CUDA when a device is there (llama3.2-1b's layer geometry, 4 layers: the
   * CUDA attention takes head_dim 64/128/256), the host backend otherwise. */
  o.backend = resolve_backend(base);
  if (o.backend == AKV_BACKEND_CUDA) {
    o.preset = "llama3.2-1b, 4 layers";
    o.g = find_preset("llama3.2-1b")->g;
    o.g.n_layers = 4;
  } else {
    o.preset = "tiny";
    o.g = find_preset("tiny")->g;
  }
  o.contexts = 3;
  o.tokens[0] = 318;
  o.tokens[1] = 255;
  o.tokens[2] = 301;
  o.n_tokens = 3;
  o.warmup = 0;
  o.page_tokens = 64;
  o.chunk_tokens = 0;
  o.check = 1;
  o.progress = 0;

  /* The last run is hybrid: layers 0 and 2 slide over 64 tokens in the
   * model's own rows, only layers 1 and 3 are staged. */
  struct {
    const char *what;
    cli_route route;
    uint32_t pool, target, burst, window;
  } runs[] = {
      {"stage", ROUTE_STAGE, 0, AKV_TARGET_FAIR_SHARE, 0, 0},
      {"arena", ROUTE_ARENA, 1, AKV_TARGET_FAIR_SHARE, 0, 0},
      {"arena, 2 pages each + 1 burst", ROUTE_ARENA, 1, 2, 1, 0},
      {"paged", ROUTE_PAGED, 1, AKV_TARGET_FAIR_SHARE, 0, 0},
      {"paged, hybrid (2 of 4 slide)", ROUTE_PAGED, 1, AKV_TARGET_FAIR_SHARE, 0, 64},
  };
  const int n_runs = (int)(sizeof runs / sizeof runs[0]);
  int identical = 0;

  if (!o.json) {
    printf("activekv demo: libactivekv %s, %s\n", akv_version_string(),
           o.backend == AKV_BACKEND_CUDA ? "CUDA backend (a GPU was found)"
                                         : "host backend (no GPU found; none needed)");
    print_geometry(&o);
    printf("run: 3 contexts of 318, 255, 301 tokens, page %u tokens, %u steps per route, each "
           "checked bit for bit against resident\n",
           o.page_tokens, o.steps);
  }
  for (int k = 0; k < n_runs; ++k) {
    run_result res;
    o.route = runs[k].route;
    o.device_pool_gib = runs[k].pool;
    o.target_pages = runs[k].target;
    o.burst_pages = runs[k].burst;
    o.g.window = runs[k].window;
    o.g.dense_every = runs[k].window ? 2 : 0;
    if (run(&o, 0, &res) != 0) return EXIT_RUN_ERROR;
    if (o.json) {
      print_json(&o, "demo", &res);
    } else {
      char a[32], b[32];
      if (k == 0) {
        print_fit(&o, &res);
        printf("\n  %-30s %10s %12s %12s %10s  %s\n", "route", "dev pool", "H2D/step",
               "D2D/step", "tokens/s", "bitwise vs resident");
      }
      printf("  %-30s %6u GiB %12s %12s %10.1f  %s (%u/%u steps)\n", runs[k].what, runs[k].pool,
             fmt_xfer(a, sizeof a, res.bytes_h2d), fmt_xfer(b, sizeof b, res.bytes_d2d),
             res.tokens_per_s, res.mismatched_steps ? "MISMATCH" : "identical",
             res.steps_compared - res.mismatched_steps, res.steps_compared);
      if (k == n_runs - 1) {
        printf("  ");
        print_counters(res.adm);
      }
    }
    identical += res.checked && res.mismatched_steps == 0;
  }
  if (!o.json) {
    if (identical == n_runs)
      printf("\nverdict: %d of %d runs give logits bit-identical to resident attention on "
             "every step\n",
             identical, n_runs);
    else
      printf("\nverdict: MISMATCH - only %d of %d runs match resident bit for bit\n", identical,
             n_runs);
  }
  return identical == n_runs ? 0 : EXIT_MISMATCH;
}

int main(int argc, char **argv) {
  cli_opts o;
  opts_default(&o);
  const char *cmd = "demo";
  int first = 1;
  if (argc > 1 && argv[1][0] != '-') {
    cmd = argv[1];
    first = 2;
  }
  if (strcmp(cmd, "demo") != 0 && strcmp(cmd, "decode") != 0 && strcmp(cmd, "fit") != 0) {
    say_error("unknown subcommand '%s'; choose demo, decode or fit (see activekv --help)", cmd);
    return EXIT_USAGE;
  }
  if (strcmp(cmd, "demo") == 0) {
    /* The demo fixes its workload; only these flags change it. */
    static const char *const allowed[] = {"--steps", "--seed", "--json",        "--verbose",
                                          "-v",      "--help", "-h",            "--no-progress",
                                          "--version"};
    o.steps = 6;
    for (int i = first; i < argc; ++i) {
      size_t n = strcspn(argv[i], "=");
      int ok = 0;
      for (size_t k = 0; k < sizeof allowed / sizeof allowed[0]; ++k)
        ok |= strlen(allowed[k]) == n && strncmp(argv[i], allowed[k], n) == 0;
      if (!ok) {
        say_error("demo takes only --steps, --seed, --json and --verbose, not '%s'; use "
                  "'activekv decode' to choose the rest",
                  argv[i]);
        return EXIT_USAGE;
      }
      if ((strcmp(argv[i], "--steps") == 0 || strcmp(argv[i], "--seed") == 0) && i + 1 < argc) ++i;
    }
  }
  int rc = parse_args(argc, argv, first, &o);
  if (rc == -1) return 0;
  if (rc != 0) return rc;
  if (strcmp(cmd, "fit") == 0) {
    /* fit prints the host-fit line and nothing else: a flag that asks for
     * something only a decode run does is refused, not ignored (--tp, say,
     * would have printed the whole model's fit, not a rank's). */
    const char *dflag = o.check                     ? "--check"
                        : o.tp > 0                  ? "--tp"
                        : o.logits_out != NULL      ? "--logits-out"
                        : o.logits_ref != NULL      ? "--logits-ref"
                        : o.release_headroom_at > 0 ? "--release-headroom-at"
                                                    : NULL;
    if (dflag != NULL) {
      char tp[32] = "";
      if (o.tp > 0 && strcmp(dflag, "--tp") == 0) snprintf(tp, sizeof tp, " %u", o.tp);
      say_error("fit: %s%s is a decode flag; fit only prints the host-fit line (run "
                "'activekv decode' with it, or drop it)",
                dflag, tp);
      return EXIT_USAGE;
    }
  }
  /* The route checks hold for fit as for decode: a fit of flags decode
   * refuses reported what no run does (--route stage with a device pool of
   * pages, the engine config making it arena). */
  const int routed = strcmp(cmd, "demo") != 0;
  if (routed && o.route == ROUTE_PAGED && chunk_tokens(&o) != o.page_tokens) {
    say_error("--chunk-tokens %u: the paged route reads whole pages in place, so the attention "
              "chunk must equal --page-tokens (%u)",
              chunk_tokens(&o), o.page_tokens);
    return EXIT_USAGE;
  }
  if (routed && o.device_pool_gib > 0 && !route_retains(o.route)) {
    say_error("--device-pool-gib %u: only --route arena or paged retains pages (stage stages every row, "
              "resident keeps every row on the device)",
              o.device_pool_gib);
    return EXIT_USAGE;
  }
  if (routed && (o.headroom_gib > 0 || o.release_headroom_at > 0) && !route_retains(o.route)) {
    say_error("--headroom-gib / --release-headroom-at: only --route arena or paged retains "
              "history in headroom");
    return EXIT_USAGE;
  }
  /* Flags that would change nothing in the run asked for are refused, not
   * ignored: the run would end as if they had not been given. */
  if (o.headroom_reserve_gib > 0 && o.headroom_gib == 0) {
    say_error("--headroom-reserve-gib %u: it is the device memory headroom leaves free, and there "
              "is no headroom; pass --headroom-gib N too, or drop it",
              o.headroom_reserve_gib);
    return EXIT_USAGE;
  }
  if (routed && !route_retains(o.route) &&
      (o.target_pages != AKV_TARGET_FAIR_SHARE || o.burst_pages > 0)) {
    say_error("%s: only --route arena or paged gives contexts device pages (--route %s retains "
              "none)",
              o.target_pages != AKV_TARGET_FAIR_SHARE ? "--target-pages" : "--burst-pages",
              route_names[o.route]);
    return EXIT_USAGE;
  }
  /* The host backend's testing aids and the knobs of an engine or a run:
   * taken where nothing acts on them, the run ended as if they had not been
   * given (a --fail-nth test "passed" with no fault). */
  if (o.delay_seed_set && o.delay_max_us == 0) {
    say_error("--host-delay-seed %llu: it seeds the delays of --host-delay-us, which is 0 (no "
              "delay); pass --host-delay-us N too, or drop it",
              (unsigned long long)o.delay_seed);
    return EXIT_USAGE;
  }
  if (resolve_backend(&o) != AKV_BACKEND_HOST && (o.delay_max_us > 0 || o.host_device_mib > 0)) {
    say_error("%s: a testing aid of the host backend; the CUDA backend has no such knob (pass "
              "--backend host, or drop it)",
              o.delay_max_us > 0 ? "--host-delay-us" : "--host-device-mib");
    return EXIT_USAGE;
  }
  /* The host backend's modelled device is this machine's memory: headroom
   * takes (and writes) up to all of it, so a device larger than the machine
   * (--host-device-mib 1000000 --headroom-gib 1024 took GiB after GiB)
   * ran until the system killed it. */
  const uint64_t machine_mem = machine_memory_bytes();
  if (o.host_device_mib > 0 && machine_mem > 0 && ((uint64_t)o.host_device_mib << 20) > machine_mem) {
    say_error("--host-device-mib %u: the modelled device is host memory, and this machine has "
              "%llu MiB; choose at most that",
              o.host_device_mib, (unsigned long long)(machine_mem >> 20));
    return EXIT_USAGE;
  }
  if (strcmp(cmd, "decode") == 0 && o.route == ROUTE_RESIDENT) {
    const char *eflag = o.fail_nth > 0                ? "--fail-nth"
                        : o.delay_max_us > 0          ? "--host-delay-us"
                        : o.host_device_mib > 0       ? "--host-device-mib"
                        : o.host_pool_gib > 0         ? "--host-pool-gib"
                        : o.fit_mode == AKV_FIT_SHRINK ? "--fit-mode shrink"
                                                      : NULL;
    if (eflag != NULL) {
      say_error("%s: --route resident runs no engine (the model keeps every row), so nothing "
                "would act on it; pass --route stage, arena or paged, or drop it",
                eflag);
      return EXIT_USAGE;
    }
  }
  if (strcmp(cmd, "fit") == 0) {
    const char *rflag = o.fail_nth > 0                           ? "--fail-nth"
                        : o.delay_max_us > 0                     ? "--host-delay-us"
                        : o.host_device_mib > 0                  ? "--host-device-mib"
                        : o.seed_set                             ? "--seed"
                        : o.pcie_set                             ? "--pcie-gbps"
                        : o.target_pages != AKV_TARGET_FAIR_SHARE ? "--target-pages"
                        : o.burst_pages > 0                      ? "--burst-pages"
                                                                 : NULL;
    if (rflag != NULL) {
      say_error("fit: %s is a decode flag; fit only prints the host-fit line (run "
                "'activekv decode' with it, or drop it)",
                rflag);
      return EXIT_USAGE;
    }
  }
  if (o.device != 0 && resolve_backend(&o) == AKV_BACKEND_HOST) {
    if (o.backend == AKV_BACKEND_HOST) {
      say_error("--device %d selects a GPU; --backend host runs on none (drop --device, or pass "
                "--backend cuda)",
                o.device);
      return EXIT_USAGE;
    }
    fprintf(stderr,
            "activekv: note: --device %d is not used: no CUDA device here, so the run takes the "
            "host backend (--backend cuda refuses instead)\n",
            o.device);
  }
  /* The logits files are opened after the prefill: a path that cannot be
   * read or written is said before anything runs. */
  /* A file the system refuses, or no logits file: a run error, as when opened. */
  if (strcmp(cmd, "decode") == 0 && o.logits_ref != NULL && logits_ref_precheck(o.logits_ref) != 0)
    return EXIT_RUN_ERROR;
  if (strcmp(cmd, "decode") == 0 && o.logits_out != NULL) {
    int werr = 0;
    if (access(o.logits_out, F_OK) == 0) {
      if (access(o.logits_out, W_OK) != 0) werr = errno;
    } else {
      /* A new file: its directory must take it. */
      char dir[4096];
      const char *slash = strrchr(o.logits_out, '/');
      if (slash == NULL) {
        snprintf(dir, sizeof dir, ".");
      } else if (slash == o.logits_out) {
        snprintf(dir, sizeof dir, "/");
      } else {
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - o.logits_out), o.logits_out);
      }
      if (access(dir, W_OK | X_OK) != 0) werr = errno;
    }
    if (werr != 0) {
      say_error("--logits-out %s: cannot write (%s)", o.logits_out, strerror(werr));
      return EXIT_RUN_ERROR;
    }
  }
  if (strcmp(cmd, "decode") == 0 && o.device_pool_gib == 0 && o.headroom_gib == 0 &&
      route_retains(o.route))
    /* Allowed (the benchmark sweeps the pool from 0), but never silent: with
     * no pool the route retains nothing and stages every row. */
    fprintf(stderr,
            "activekv: note: --route %s with --device-pool-gib 0 retains no page: every row "
            "is staged each step, as on --route stage (pass --device-pool-gib N to retain "
            "pages)\n",
            route_names[o.route]);
  if (strcmp(cmd, "fit") == 0) return cmd_fit(&o);
  if (strcmp(cmd, "decode") == 0) return cmd_decode(&o);
  return cmd_demo(&o);
}
