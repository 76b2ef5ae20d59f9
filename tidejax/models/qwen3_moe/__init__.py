"""The Qwen3-MoE family (qwen3_moe): config, weights (declared params + checkpoint table), model, family."""
