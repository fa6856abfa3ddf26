"""Config composition through Hydra's compose API (nothing launched)."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from ddp_lab.config import validate
from ddp_lab.errors import ConfigError
from helpers import compose_config


def test_defaults_compose_and_validate():
    cfg = compose_config()
    validate(cfg)
    assert (cfg.model.name, cfg.data.name, cfg.sync.name, cfg.precision.name, cfg.optim.name) == \
        ("alexnet_cifar", "digits", "ddp", "fp32", "sgd")
    assert cfg.data.image_size == 32  # follows the model


def test_overrides_land():
    cfg = compose_config(["model=alexnet", "data=synthetic", "precision=bf16", "optim=adamw",
                          "train.batch_size=7", "sync.bucket_mb=4", "optim.lr=0.5"])
    assert cfg.model.name == "alexnet" and cfg.data.image_size == 224
    assert cfg.data.num_classes == 1000  # synthetic takes the model's default classes
    assert cfg.precision.autocast_dtype == "bfloat16"
    assert cfg.train.batch_size == 7 and cfg.optim.lr == 0.5
    assert cfg.sync.bucket_mb == 4


def test_unknown_group_option_lists_choices():
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["model=resnet"])
    assert "alexnet_cifar" in str(e.value.__cause__ or e.value) or "alexnet" in str(e.value)


def test_unknown_key_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["train.batchsize=3"])
    assert isinstance(e.value.__cause__, (ConfigKeyError, Exception))
    assert "batchsize" in str(e.value) or "batchsize" in str(e.value.__cause__)


def test_bad_type_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["train.batch_size=many"])
    assert isinstance(e.value.__cause__, ValidationError)


@pytest.mark.parametrize("override, needle", [
    ("train.batch_size=0", "train.batch_size=0 must be > 0"),
    ("train.accum_steps=-1", "train.accum_steps"),
    ("model.dropout=1.5", "model.dropout"),
    ("dist.backend=mpi", "dist.backend='mpi' is not one of"),
    ("sync.comm_dtype=int8", "sync.comm_dtype"),
])
def test_validate_rejects_meaningless_values(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        validate(compose_config([override]))
