"""Models and tokenizers from local paths or the Hub: configs checked before weights load, loading errors in one line,
the pad and stop tokens, LoRA adapters and the reference with them switched off, --merge_lora, the bf16 sampling copy.
"""

import contextlib
import copy
import functools
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import WRITE_ERRORS, ConfigError, Fault, check_input_directory, first_line, inert, program, reading
from .flags import missing_local_path, policy_options
from .folders import Folder
from .outputdir import MERGED, move_aside

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "load_pretrained", "ensure_pad_token", "load_config", "same_vocabulary", "load_tokenizer", "load_causal_lm",
    "load_reward_model", "stop_token_id_of", "prepare_tokenizer", "check_model_configs", "weight_decay_groups",
    "add_adapters", "disable_dropout", "AdaptersOff", "bf16_copy", "copy_weights", "quiet_hub_progress_bars",
    "ADAPTER_WEIGHTS", "ADAPTER_CONFIG",
]


@contextlib.contextmanager
def transformers_quiet():
    """transformers' warnings unprinted (its errors still raise)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def load_pretrained(loader: Callable, path: str, what: str, **kwargs):
    """loader(path, **kwargs), the one boundary of a model, tokenizer or config (reading): whatever it raises is one
    line naming it, and a local-looking path that is not there is said so (not the Hub's answer to a malformed
    repo id). transformers' load report is not printed: newly_initialized says what matters in it."""
    problem = missing_local_path(path)
    if problem:
        raise ConfigError(f"could not load {what} from {path!r}: {problem}")
    if Path(path).is_dir():
        check_input_directory(path, f"{what} {path!r}", "put the file written by save_pretrained back")
    with transformers_quiet(), reading(f"could not load {what} from {path!r}",
                                       "without network, pass a local directory written by save_pretrained"):
        return loader(path, **kwargs)


def newly_initialized(loaded: tuple, what: str, path: str, fix: str):
    """The model of from_pretrained(..., output_loading_info=True), refused in one line when weights its class needs
    are not in its files (transformers would initialize them at random; tied weights are not missing)."""
    model, info = loaded
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(f"{what} {path!r} lacks weights its {type(model).__name__} needs ({shown}): they would be "
                          f"newly initialized at random; {fix}")
    return model


def ensure_pad_token(tokenizer, pad_token: Optional[str], embedding_rows: int, name: str) -> None:
    """Give the tokenizer a pad token that the model can embed, or refuse with the fix."""
    if tokenizer.pad_token_id is not None:
        return
    if pad_token is None:
        raise ConfigError(
            f"the tokenizer of {name} has no pad token: save one with a pad token, or pass --pad_token TOKEN"
        )
    tokenizer.add_special_tokens({"pad_token": pad_token})
    if tokenizer.pad_token_id >= embedding_rows:
        raise ConfigError(
            f"the tokenizer of {name} has no pad token, and adding {pad_token!r} gives id {tokenizer.pad_token_id}, "
            f"outside the model's {embedding_rows}-row embedding: save a tokenizer with a pad token (resizing "
            "the embeddings) or pass --pad_token with a token the tokenizer already has"
        )


def load_config(path: str, what: str, trust_remote_code: bool, revision: str = "main"):
    from transformers import AutoConfig

    return load_pretrained(AutoConfig.from_pretrained, path, what, trust_remote_code=trust_remote_code,
                            revision=revision)


REWARD_MODEL_FIX = ("pass a reward model trained and saved as an AutoModelForSequenceClassification with num_labels=1, "
                    "or score with --reward_fn")


POLICY_FIX = "pass a causal LM saved by save_pretrained (an AutoModelForCausalLM with its lm_head)"


def check_reward_model_config(path: str, trust_remote_code: bool, policy_vocab_size: Optional[int] = None,
                              args=None, longest_prompt: Optional[int] = None) -> None:
    """A saved classification head must give one score per sequence (a causal LM gets a new one-label head); a
    reward model without tokenizer files reads the policy's token ids, which needs the policy's vocabulary; with
    `args` and `longest_prompt`, that prompt and a response fit its positions (check_context)."""
    config = load_config(path, "reward model", trust_remote_code)
    check_sizes(config, "reward model")
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if policy_vocab_size is not None and vocab_size not in (None, policy_vocab_size) and not has_tokenizer(path):
        raise ConfigError(f"reward model {path!r} has no tokenizer files, so it would read the policy's token ids, but "
                          f"its vocabulary has {vocab_size} ids and the policy's {policy_vocab_size}: save the reward "
                          "model's tokenizer with it (tokenizer.save_pretrained(path))")
    if args is not None and longest_prompt is not None:
        check_context(config, "reward model", args, longest_prompt)
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or ())
    causal = [name for name in config.architectures or () if name.endswith(("ForCausalLM", "LMHeadModel"))]
    if causal and not classifier:
        raise ConfigError(f"reward model {path!r} is a {inert(causal[0], 60)}, not a reward model: its score head "
                          f"would be newly initialized, random scores; {REWARD_MODEL_FIX}")
    if classifier and config.num_labels != 1:
        raise ConfigError(f"reward model {path!r} has a {config.num_labels}-label classification head, but a reward is "
                          "one number per completion: use a reward model saved with num_labels=1")


def same_vocabulary(a, b) -> bool:
    """True when token ids mean the same text in both tokenizers (each one's pad token aside)."""
    vocab_a = {t: i for t, i in a.get_vocab().items() if t != a.pad_token}
    vocab_b = {t: i for t, i in b.get_vocab().items() if t != b.pad_token}
    return vocab_a == vocab_b


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's names, as transformers' save_pretrained writes an adapter


ADAPTER_CONFIG = "adapter_config.json"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def has_tokenizer(path: str) -> bool:
    """Whether the model at `path` has its own tokenizer: a local directory with tokenizer files (transformers
    would build an empty tokenizer from a config alone), or a Hub id (its files are looked for there)."""
    return not Path(path).is_dir() or any((Path(path) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(path: str, trust_remote_code: bool, revision: str = "main"):
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        # transformers would build an empty tokenizer from the config alone, which makes every prompt empty
        raise ConfigError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:3])}, ...): save the "
                          "model's tokenizer there (tokenizer.save_pretrained(path))")
    return load_pretrained(
        AutoTokenizer.from_pretrained, path, "tokenizer", padding_side="left", trust_remote_code=trust_remote_code,
        revision=revision)


def load_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool, weights: Optional[Path] = None,
                   revision: str = "main", **options):
    """The model at `path` (at that Hub revision); with `weights` (a checkpoint), only its weights, in safetensors,
    come from there: the architecture and any remote code still come from `path`, so that a checkpoint can choose no
    code to run. `options`: from_pretrained's (policy_options: attention, quantization)."""
    from transformers import AutoModelForCausalLM

    if weights is None:
        model = newly_initialized(load_pretrained(
            AutoModelForCausalLM.from_pretrained, path, "policy", dtype=dtype, trust_remote_code=trust_remote_code,
            revision=revision, output_loading_info=True, **options), "policy", path, POLICY_FIX)
    else:
        config = load_config(path, "policy", trust_remote_code, revision)
        with torch.device("meta"):  # the class only: nothing allocated
            model_class = type(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
        model = newly_initialized(load_pretrained(
            model_class.from_pretrained, str(weights), "policy", config=config, dtype=dtype, use_safetensors=True,
            output_loading_info=True, **options), "checkpoint", str(weights),
            "resume from an intact checkpoint (--resume_from)")
    for module in model.modules():  # bitsandbytes' 4-bit layers: on a CPU with AVX512-BF16 a forward without
        if hasattr(module, "support_avx512bf16_for_cpu"):  # gradient repacks the weights for a bf16 kernel, so
            module.support_avx512bf16_for_cpu = False  # the sampler would see another base than the trainer
    return model


def load_reward_model(path: str, dtype: torch.dtype, trust_remote_code: bool,
                      attn_implementation: Optional[str] = None):
    from transformers import AutoModelForSequenceClassification

    model = newly_initialized(load_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        path,
        "reward model",
        num_labels=1,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    ), "reward model", path, REWARD_MODEL_FIX)
    if not hasattr(model, "score"):
        raise ConfigError(f"reward model {path!r} has no `score` head; use an AutoModelForSequenceClassification model")
    return model


def stop_token_id_of(args, tokenizer, tokenizer_path: str) -> Optional[int]:
    """--stop_token_id, or the tokenizer's EOS with --stop_token eos, or None."""
    if args.stop_token_id is not None or args.stop_token != "eos":
        return args.stop_token_id
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--stop_token eos but the tokenizer of {tokenizer_path} has no EOS: pass --stop_token_id")
    return tokenizer.eos_token_id


def prepare_tokenizer(args):
    """The policy's tokenizer with a pad token, and the policy's vocabulary size (None if its config does not say),
    checked from the models' configs before any weights load: the pad and stop token ids fit the vocabulary, the
    reward model's head gives one score."""
    tokenizer_path = args.model_name_or_path or args.sft_model_path
    tokenizer = load_tokenizer(tokenizer_path, args.trust_remote_code, args.model_revision)
    config = load_config(args.sft_model_path or args.model_name_or_path, "policy", args.trust_remote_code,
                         args.model_revision)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None:
        ensure_pad_token(tokenizer, args.pad_token, vocab_size, tokenizer_path)
        stop_token_id = stop_token_id_of(args, tokenizer, tokenizer_path)
        if stop_token_id is not None and stop_token_id >= vocab_size:
            raise ConfigError(f"stop_token_id = {stop_token_id} is outside the policy's vocabulary of {vocab_size}: "
                              "pass an id below it")
    check_model_configs(args, config)
    return tokenizer, vocab_size


def check_model_configs(args, policy_config, longest_prompt: Optional[int] = None) -> None:
    """What the models' configs alone tell (no tokenizer, no weights; plan_memory.py makes the same checks): its
    sizes make a model (check_sizes), the reward model's head gives one score, its vocabulary fits; with
    `longest_prompt` (tokens: the data's, once read, check_positions; plan_memory.py's planned length), that prompt and
    its response fit both models' positions."""
    check_sizes(policy_config, "policy")
    if longest_prompt is not None:
        check_context(policy_config, "policy", args, longest_prompt)
    if args.reward_model_path is not None:
        check_reward_model_config(args.reward_model_path, args.trust_remote_code,
                                  getattr(policy_config.get_text_config(), "vocab_size", None), args, longest_prompt)


MODEL_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
MAX_LAYERS = 10_000  # the largest models have a few hundred; building (on the meta device too) loops over them


def check_sizes(config, what: str) -> None:
    """The sizes of a model's config (MODEL_SIZES, where it has them) are whole numbers >= 1, and its layers at most
    MAX_LAYERS: a 0 or a negative size is a ZeroDivisionError or a negative dimension deep in the model's code, 10^12
    layers a build that never ends."""
    text = config.get_text_config()
    for name in MODEL_SIZES:
        value = getattr(text, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"the {what}'s config has {name} = {value!r}: a model's sizes are whole numbers >= 1; "
                              "fix its config.json")
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ConfigError(f"the {what}'s config has num_hidden_layers = {layers:,}, more than the {MAX_LAYERS:,} a "
                          "model here may have: fix its config.json")


def check_positions(args, longest_prompt: int) -> None:
    """The data's longest tokenized prompt (train and test, after --max_prompt_length's cut) and --response_length
    within the models' positions (check_context): the data's length, not the flag's cap, which alone neither refuses
    nor warns."""
    policy = load_config(args.sft_model_path or args.model_name_or_path, "policy", args.trust_remote_code,
                         args.model_revision)
    check_context(policy, "policy", args, longest_prompt)
    if args.reward_model_path is not None:
        check_context(load_config(args.reward_model_path, "reward model", args.trust_remote_code), "reward model",
                      args, longest_prompt)


def check_context(config, what: str, args, longest_prompt: int) -> None:
    """The longest prompt (tokens) and a response within the model's positions (max_position_embeddings, under any
    of its names). A learned position table (GPT-2's, OPT's) has no row past its end, where the run would fail in the
    middle: refused. Positions computed (rotary, ALiBi) go on past it, where the model was not trained: a warning. A
    model that declares no limit (state-space models) is not checked."""
    text = config.get_text_config()
    positions, needed = getattr(text, "max_position_embeddings", None), longest_prompt + args.response_length
    if not isinstance(positions, int) or not 0 < positions < needed:
        return
    computed = getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "absolute") != "absolute" \
        or any(getattr(text, name, None) is not None for name in ("rope_parameters", "rope_scaling", "rope_theta",
                                                                   "rotary_dim", "rotary_pct", "rotary_emb_base"))
    fixes = [f"--max_prompt_length to {positions - args.response_length} or less (longer prompts are dropped)"] \
        if positions > args.response_length else []  # only a fix that leaves room for the other length is offered
    fixes += [f"--response_length to {positions - longest_prompt} or less"] if positions > longest_prompt else []
    fix = " or ".join(fixes) if fixes else f"--max_prompt_length and --response_length to a sum of {positions} or less"
    if not computed:
        raise ConfigError(f"the longest prompt, {longest_prompt} tokens, + --response_length {args.response_length} = "
                          f"{needed} tokens, but the {what} has {positions} positions (max_position_embeddings), "
                          f"a learned table with no row past them: lower {fix}")
    if os.environ.get("RANK", "0") == "0":
        print(f"{program()}: warning: the longest prompt, {longest_prompt} tokens, + --response_length = "
              f"{needed} tokens exceed the {what}'s {positions} positions (max_position_embeddings), where it was not "
              f"trained: lower {fix}", file=sys.stderr)


def save_merged_policy(args, config, tokenizer) -> None:
    """--merge_lora: the base with output_dir's final adapter merged in by peft (a fresh fp32 copy of the base, in
    CPU memory), in transformers' format with the tokenizer, at output_dir/merged; loads without peft. A
    --load_in_4bit base is quantized again and dequantized to fp32 (exactly the 4-bit weights), so that the merged
    model computes what trained: merging into the original weights would drop the quantization the adapters saw."""
    from peft import PeftModel

    merged_dir = Path(args.output_dir) / MERGED
    base = load_causal_lm(args.sft_model_path or args.model_name_or_path, torch.float32, args.trust_remote_code,
                          **policy_options(args))
    if args.load_in_4bit:
        with transformers_quiet():  # its note that it dequantizes: what was asked for
            base = base.dequantize()
    merged = PeftModel.from_pretrained(base, args.output_dir).merge_and_unload()
    merged.config.pad_token_id = config.pad_token_id
    try:  # written by the libraries into a private folder, whose checked files then take the name merged
        with Folder.at(args.output_dir) as root, root.private(".partial-") as private:
            try:
                merged.save_pretrained(private.os_path)
                tokenizer.save_pretrained(private.os_path)
                with root.private(".partial-") as files:  # each file checked (one name, no link), the umask's mode
                    files.adopt(private)
                    files.chmod()
                if root.lstat(MERGED) is not None:  # an earlier finish's: set aside, never written over
                    move_aside(args.output_dir, [MERGED], "merged_replaced")
                root.move(files.path.name, root, MERGED)
            finally:
                root.remove_tree(private.path.name)
    except WRITE_ERRORS as e:
        raise Fault(f"could not write the merged policy to {merged_dir}: {first_line(e)}; the adapter in "
                    f"{args.output_dir} is intact: merge it with peft's merge_and_unload") from e


def lora_config(args):
    """peft's LoraConfig from the --lora_* flags (TRL's ModelConfig names; one target name is passed as a string,
    as TRL does, so that `all-linear` means every linear layer)."""
    from peft import LoraConfig

    targets = args.lora_target_modules
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                      use_rslora=args.use_rslora, use_dora=args.use_dora,
                      target_modules=targets[0] if targets and len(targets) == 1 else targets and list(targets),
                      modules_to_save=args.lora_modules_to_save and list(args.lora_modules_to_save),
                      target_parameters=args.lora_target_parameters and list(args.lora_target_parameters))


def weight_decay_groups(model, trainable: list, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups for --weight_decay as transformers' Trainer makes them (TRL's): every trained weight
    decays but biases and norms (Trainer.get_decay_parameter_names, which reads only the model); one group when it
    is 0."""
    if weight_decay == 0:
        return [{"params": trainable, "weight_decay": 0.0}]
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in decay], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def add_adapters(policy, args, checkpoint: Optional[Path]) -> None:
    """LoRA adapters injected into the policy's own modules by peft (through transformers' add_adapter, so that
    the policy keeps its class, config and forward), fp32 like the base's master weights (--bf16 autocasts them as
    it does the base); only they require grad. Initialized from --seed, or read from the checkpoint's adapter."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    with torch.random.fork_rng(devices=[]):  # the same initial adapter on every rank, from --seed alone
        torch.manual_seed(args.seed)
        try:
            policy.add_adapter(lora_config(args))
        except ValueError as e:  # no target modules known for the architecture, a name that matches nothing, or a
            # module peft cannot adapt in this model (Mamba's out_proj, which all-linear reaches)
            other = "" if "all-linear" in (args.lora_target_modules or ()) else ", or all-linear"
            raise ConfigError(f"--use_peft: {first_line(e)} - pass --lora_target_modules (module names{other})") \
                from None
    policy.eval()  # peft's new modules come in train mode, their --lora_dropout on: off until training switches it on
    base = policy.peft_config["default"].base_model_name_or_path  # the path as typed; a Hub id stays as it is
    if base and Path(base).is_dir():  # absolute: the saved adapter loads its base from any folder
        policy.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    if checkpoint is None:
        return
    prefix = "base_model.model."  # what peft's format prepends to the model's own parameter names
    saved = {name.removeprefix(prefix): value for name, value in load_file(checkpoint / ADAPTER_WEIGHTS).items()}
    expected = policy.get_adapter_state_dict()
    if saved.keys() != expected.keys() or any(saved[n].shape != expected[n].shape for n in saved):
        raise ConfigError(f"cannot resume: the adapter in {checkpoint} does not match --lora_* ({len(saved)} tensors "
                          f"for {len(expected)}): resume with the checkpoint's run's flags")
    set_peft_model_state_dict(policy, saved, adapter_name="default")


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs the sampling policy and the trained policy to be the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def peft_layers(model) -> list[torch.nn.Module]:
    """The modules peft put adapters (or trained copies, --lora_modules_to_save) in."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


class AdaptersOff(torch.nn.Module):
    """The frozen reference of a LoRA policy: the policy itself called with its adapters switched off, without
    gradient, so the base's weights are never copied. It holds no weights of its own: the policy is not a submodule
    (.to(), .train(), state_dict() never reach it), parameters() are the policy's (where `visiting` looks for
    them), and every other attribute, the config and the backbone included, is the policy's. Its forward takes
    what the policy's forward takes."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self._policy = (policy,)  # in a tuple: not registered as a submodule
        self.forward = functools.wraps(policy.forward)(functools.partial(AdaptersOff._forward, self))  # its signature

    def _forward(self, *args, **kwargs):
        policy = self._policy[0]
        layers = peft_layers(policy)
        # peft's enable_adapters sets requires_grad on the tensors registered at the time; FSDP2 registers the shards
        # before the forward and, where a unit stays gathered (gathered_for_rollout), the whole tensors after it, and
        # gathers with the shards' flag: so the trainable tensors are set trainable again themselves
        trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        with torch.no_grad():
            for layer in layers:
                layer.enable_adapters(False)
            try:
                return policy(*args, **kwargs)
            finally:  # back on, trainable again
                for layer in layers:
                    layer.enable_adapters(True)
                for p in trainable:
                    p.requires_grad_(True)

    def parameters(self, recurse: bool = True):
        return self._policy[0].parameters(recurse)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_policy":
                raise
            return getattr(self._policy[0], name)


def bf16_copy(policy):
    """A frozen bf16 copy of the policy to sample from (--bf16_generation)."""
    return copy.deepcopy(policy).to(torch.bfloat16).eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(source, target) -> None:
    """target's parameters := source's, cast to target's dtype (the same module structure)."""
    for to, value in zip(target.parameters(), source.parameters(), strict=True):
        to.copy_(value)


def quiet_hub_progress_bars() -> None:
    """Loading bars of datasets and transformers would bury the run's own lines (and one-line errors)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
