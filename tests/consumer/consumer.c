/* A tiny program built against the installed package. */
#include <akv.h>
#include <stdio.h>

int main(void) {
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_fit_report fit;
  cfg.n_dense_layers = 16;
  cfg.kv_heads = 8;
  cfg.head_dim = 64;
  cfg.max_tokens = 31744;
  cfg.max_contexts = 8;
  cfg.host_pool_gib = 64;
  if (akv_fit(&cfg, &fit) != AKV_OK) return 1;
  printf("activekv %s: %s\n", akv_version_string(), fit.line);
  return akv_version_number() == AKV_VERSION_NUMBER ? 0 : 2;
}
