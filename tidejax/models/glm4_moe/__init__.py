"""The GLM-4.5 family (glm4_moe): config, weights (declared params + checkpoint table), model, family."""
