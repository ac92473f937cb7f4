"""KV cache: one fixed layout on every backend, [layer][k|v][kv_head][position][head_dim], float16."""
