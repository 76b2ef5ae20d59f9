"""The Mixtral family (mixtral): config, weights (declared params + checkpoint table), model, family."""
