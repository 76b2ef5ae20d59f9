"""The GLM-5 family (glm_moe_dsa): config, weights (declared params, the MTP layers kept on
the host, checkpoint table), model, family."""
