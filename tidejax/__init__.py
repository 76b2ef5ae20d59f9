"""tidejax: serve mixture-of-experts models larger than GPU memory, with adaptive expert residency."""

from tidejax.runtime import Engine, load

__version__ = "0.1.0"


def generate(model_or_profile, prompts, **kwargs):
    """Loads `model_or_profile` (checkpoint dir, profile path or name) and generates in one call.

    Keyword arguments go to `Engine.generate` (max_new_tokens, stop, on_text and the
    SamplingParams fields: temperature, top_p, top_k, seed, min_p, the penalties, logit_bias);
    profile tables (model=, engine=, residency=) go to `load`.
    """
    tables = {k: kwargs.pop(k) for k in ("model", "engine", "residency", "server") if k in kwargs}
    return load(model_or_profile, **tables).generate(prompts, **kwargs)


__all__ = ["Engine", "generate", "load"]
