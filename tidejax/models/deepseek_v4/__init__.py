"""The DeepSeek-V4 family: config, weights (declared params + transformers' tensor names), model.
Not yet served by the engine (no family.py registers it): parity against transformers only."""
