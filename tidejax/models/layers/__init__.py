"""Layers shared by the model families (each family composes them; none imports a family).

Einsum letters used across tidejax.models:
  b batch, t query tokens, s key/cache positions, d model width, h heads,
  k head width (query/key), v head width (value), c compressed latent (MLA kv_lora_rank),
  r rotary width, f feed-forward width, e experts.
"""

