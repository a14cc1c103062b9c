"""The plumbing of rloo.py: what a run needs and nobody changes when changing the algorithm, one module per concern.

rloo.py holds the algorithm and calls this package as `plumbing.X` (X: what a module names in its `__all__`);
rloo_multinode.py imports both. Copying rloo.py means copying this folder with it. Nothing here imports rloo.py: what
needs the run's objects (the algorithm's functions included) takes them as arguments. The rooms, each imported only
by those below it:

  startup       before torch loads: OpenMP's waiting threads sleep; Ctrl-C while a script imports is one line
  errors        ConfigError (bad input: one line, exit 2), Fault (a run stopped: one line, exit 4), reading an input,
                outside words made inert
  folders       the run's folders by handle: new files only, never through a link, libraries' files put in place
  flags         InputArgs (models, data) and RunArgs (the run's flags), which rloo.py's Args extends; their checks
  schedule      the run's length in updates and optimizer steps, the interval flags' unit, the learning rate of each
                optimizer step: TRL <= 0.21's arithmetic or TRL 1.16's Trainer's (--trl_defaults 1.16)
  distributed   torchrun's ranks, their devices and seeds, FSDP2, all-reduce, late ranks named
  faults        stop signals, NaN/inf on every rank and the offending batch, the rollout source's failure, the
                console that cannot stop a run, work in a thread a signal can stop
  data          the prompt files and datasets, with one-line diagnostics; tokenized, held to --max_prompt_length;
                the prompt sampler
  models        models and tokenizers loaded and checked, LoRA adapters and their reference, the bf16 sampling copy
  kernels       the fused log-softmax, logits where needed, KV caches, what a model's attention is
  sharing       the shortcuts' checks: prompt sharing per model, the on-policy update's advantages (first update)
  rewards       reward model and functions: loaded, called in a thread with a timeout, failures raised on every rank
  measure       phase times, token-forwards against the minimum, rows per forward pass, sampler/trainer mismatch
  runlog        metrics over ranks, the console, metrics.jsonl, wandb, curves.png
  outputdir     one run per output_dir, the files a run writes and owns, nothing of another run overwritten
  checkpoints   verified saves, resume, RNG states, the algorithm's state, the inputs' identities, nothing run
                from a checkpoint
  cli           the command line, TRL's names, exit statuses; run_tool, every helper script's boundary
"""

from .startup import *  # noqa: F401,F403  first: before anything imports torch
from .errors import *  # noqa: F401,F403
from .folders import *  # noqa: F401,F403
from .flags import *  # noqa: F401,F403
from .schedule import *  # noqa: F401,F403
from .distributed import *  # noqa: F401,F403
from .faults import *  # noqa: F401,F403
from .data import *  # noqa: F401,F403
from .models import *  # noqa: F401,F403
from .kernels import *  # noqa: F401,F403
from .sharing import *  # noqa: F401,F403
from .rewards import *  # noqa: F401,F403
from .measure import *  # noqa: F401,F403
from .runlog import *  # noqa: F401,F403
from .outputdir import *  # noqa: F401,F403
from .checkpoints import *  # noqa: F401,F403
from .cli import *  # noqa: F401,F403
