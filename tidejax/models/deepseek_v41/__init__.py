"""The DeepSeek-V4.1 family: config, weights (declared params + checkpoint table), model, family
(the engine's hooks), engram (the host side of the n-gram memory)."""
