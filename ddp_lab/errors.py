"""The two kinds of error a ddp_lab command reports as one line instead of a traceback
(ddp_lab/cli.py): a user's mistake, and training that cannot go on."""


class ConfigError(ValueError):
    """A user error in the configuration or environment: printed as one clear line, exit code 2."""


class TrainingError(RuntimeError):
    """Training cannot go on: printed as one line, exit code 3. `every_rank`: each rank's message
    differs (print them all); otherwise the ranks decided together and rank 0 speaks for all."""
    every_rank = False
