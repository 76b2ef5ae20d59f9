"""The gpt-oss family (gpt_oss): config, weights (declared params + checkpoint table), model,
family."""
