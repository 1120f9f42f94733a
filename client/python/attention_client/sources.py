"""Where LoadLayer (or an inline layer) takes a layer's weights from.

Each function returns an attention.v1.LayerSpec with only its `weights` member set;
make_layer_spec adds the config. A new source of the proto is one more function here:

    load_layer("enc0", config, source=safetensors("bert/model.safetensors",
                                                   naming="hf_bert", prefix="encoder.layer.0."))
"""

from . import stubs
from . import tensors


def naming_enum(naming):
    """'native' | 'torch_mha' | 'hf_bert' | 'hf_llama' (any WeightNaming, case-insensitive,
    with or without the WEIGHT_NAMING_ prefix) or its enum value -> enum value."""
    if isinstance(naming, int):
        return naming
    pb2 = stubs.load()[0]
    name = naming.upper()
    if not name.startswith("WEIGHT_NAMING_"):
        name = "WEIGHT_NAMING_" + name
    try:
        return pb2.WeightNaming.Value(name)
    except ValueError:
        names = [n[len("WEIGHT_NAMING_"):].lower() for n in pb2.WeightNaming.keys()]
        raise ValueError("unknown weight naming %r; use one of %s" % (naming, names))


def inline(weights, naming="native", prefix="", dtype="float32"):
    """Weights sent with the request: a dict tensor name -> numpy array or torch tensor
    (a module's state_dict() with naming="torch_mha" / "hf_bert" / "hf_llama" as it is).
    `dtype` is the wire dtype of every tensor: "float32", "float16" or "bfloat16"."""
    pb2 = stubs.load()[0]
    spec = pb2.LayerSpec()
    spec.inline_weights.naming = naming_enum(naming)
    spec.inline_weights.prefix = prefix
    for name, array in weights.items():
        tensors.encode(array, dtype, out=spec.inline_weights.tensors[name])
    return spec


def safetensors(path, naming="native", prefix=""):
    """A safetensors file in the server's --model_repository; `path` relative to it and
    `prefix` selecting one layer of a checkpoint, e.g. "encoder.layer.0."."""
    pb2 = stubs.load()[0]
    return pb2.LayerSpec(safetensors=pb2.SafetensorsSource(
        path=path, naming=naming_enum(naming), prefix=prefix))


def hf_checkpoint(path, layer_index):
    """Layer `layer_index` of a Hugging Face checkpoint directory in the server's
    --model_repository (config.json + model.safetensors, or its index and shards, as
    save_pretrained writes them). The server reads the layer's config from config.json; a
    `config` given with it must agree."""
    pb2 = stubs.load()[0]
    return pb2.LayerSpec(hf_checkpoint=pb2.HuggingFaceCheckpoint(
        path=path, layer_index=int(layer_index)))


def random_init(seed):
    """The server's seeded random initialisation (same seed, same layer on every machine)."""
    pb2 = stubs.load()[0]
    return pb2.LayerSpec(random_init=pb2.RandomInit(seed=int(seed)))
