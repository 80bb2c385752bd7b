"""GLM-5.3-Flash model: args, the model, and HF checkpoint I/O."""

from .args import Glm5ModelArgs, ModelArgsError, get_flavor
from .model import Glm5LossOutput, Glm5Model, Glm5Output, count_params


def __getattr__(name: str):
    # hf_io imports safetensors lazily; keep `import torchtitan_glm.models.glm5` light.
    if name in ("from_pretrained", "save_pretrained"):
        from . import hf_io

        return getattr(hf_io, name)
    raise AttributeError(name)


__all__ = ["Glm5LossOutput", "Glm5Model", "Glm5ModelArgs", "Glm5Output", "ModelArgsError", "count_params",
           "from_pretrained", "get_flavor", "save_pretrained"]
