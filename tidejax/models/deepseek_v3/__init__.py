"""The DeepSeek-V3 family: config, weights (declared params + checkpoint table), model, family."""
