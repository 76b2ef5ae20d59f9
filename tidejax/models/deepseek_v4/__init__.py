"""The DeepSeek-V4 family: config, weights (declared params + checkpoint table), model, family."""
