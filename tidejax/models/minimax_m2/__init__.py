"""The MiniMax-M2 family (minimax_m2): config, weights (declared params + checkpoint table), model, family."""
