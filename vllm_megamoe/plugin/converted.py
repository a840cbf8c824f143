"""Loading checkpoints converted offline by `vllm-megamoe convert`.

Their expert weights are stored stacked per layer, already in the kernel layout
(`<experts module>.w13_weight [E, 2I, H]`, `.w2_weight`, FP8 `.w13_weight_scale_inv`, ...), names
vLLM's per-expert loaders do not know. While such a checkpoint loads, this module takes those
tensors out of the weight stream and copies this rank's experts straight into the FusedMoE
parameters, as stored: no conversion at load time.

It also checks the shards against the sha256 checksums of the index (VLLM_MEGAMOE_VERIFY_CHECKPOINT,
default on): once vLLM has found the checkpoint's files, a thread of each worker hashes its share of
them (largest first to the least loaded worker: every shard is hashed by one worker) while vLLM reads
them, so the hashing overlaps the load; after the load the workers exchange what they found and every
one fails with the same message when a shard does not match.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Iterable, Iterator, Optional

import torch

logger = logging.getLogger("vllm.plugins.megamoe")

STACKED_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


class ConvertedExpertLoader:
    """Filters a (name, tensor) stream: stacked expert tensors go into the model directly."""

    def __init__(self, model: torch.nn.Module, marker: dict):
        self.marker = marker
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module_name, _, param_name = name.rpartition(".")
            if param_name in STACKED_PARAMS and module_name.endswith("experts"):
                self._copy(module_name, param_name, tensor)
                continue
            yield name, tensor

    def _find(self, module_name: str, param_name: str):
        """(module name, module) holding `param_name`: the experts module itself or the
        RoutedExperts child vLLM keeps the weights in (possibly under a LoRA base_layer)."""
        for suffix in ("", ".routed_experts", ".base_layer", ".routed_experts.base_layer"):
            module = self.modules.get(module_name + suffix)
            if module is not None and isinstance(getattr(module, param_name, None), torch.nn.Parameter):
                return module_name + suffix, module
        raise ValueError(
            f"converted checkpoint tensor {module_name}.{param_name} has no parameter in the vLLM "
            f"model (no {param_name} under {module_name!r}); was the checkpoint converted from this model?")

    def _copy(self, module_name: str, param_name: str, tensor: torch.Tensor) -> None:
        module_name, module = self._find(module_name, param_name)
        param = getattr(module, param_name)
        backend = getattr(module.moe_config, "moe_backend", None)
        if backend != "megamoe":
            raise ValueError(
                f"this checkpoint was converted by `vllm-megamoe convert` (arch {self.marker.get('arch')}, "
                f"format {self.marker.get('format')}): its expert weights are in the megamoe kernel "
                f"layout, which MoE backend {backend!r} would read wrongly. Serve it with "
                "--moe-backend megamoe, or serve the original checkpoint")
        par = module.moe_config.moe_parallel_config
        if par.tp_size > 1 and not par.use_ep:
            raise ValueError(
                "a checkpoint converted by vllm-megamoe stores whole experts; serve it with "
                "--enable-expert-parallel (experts split over ranks) rather than tensor-parallel "
                "experts, or serve the original checkpoint")
        local = param.shape[0]
        start = (par.ep_rank if par.use_ep else 0) * local
        shard = tensor[start:start + local]
        if tuple(shard.shape) != tuple(param.shape) or shard.dtype != param.dtype:
            raise ValueError(
                f"converted tensor {module_name}.{param_name}: experts [{start}, {start + local}) of "
                f"{tuple(tensor.shape)} {tensor.dtype} do not match the parameter "
                f"{tuple(param.shape)} {param.dtype}")
        param.data.copy_(shard)
        self.loaded.add(f"{module_name}.{param_name}")

    def log_summary(self) -> None:
        m = self.marker
        logger.info("megamoe: loaded %d stacked expert tensors of a checkpoint converted offline "
                    "(arch %s, format %s, layout v%s) as stored: no runtime conversion",
                    len(self.loaded), m.get("arch"), m.get("format"), m.get("layout_version"))


VERIFY_ENV = "VLLM_MEGAMOE_VERIFY_CHECKPOINT"


def assign_shards(sizes: dict, world: int) -> list:
    """Split shards {file name: bytes} over `world` workers: largest first, each to the worker with
    the fewest bytes so far (ties to the lowest rank). Every worker computes the same split."""
    shares, loads = [[] for _ in range(world)], [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda k: (loads[k], k))
        shares[r].append(name)
        loads[r] += sizes[name]
    return shares


class ShardChecksums:
    """This worker's share of a converted checkpoint's shards, hashed in a background thread.

    folder: the checkpoint directory; files: the weight files vLLM loads from it (paths or names).
    The shards are split over the workers from the index alone (every shard it has a checksum for,
    whichever worker loads it), so every worker computes the same split and each shard is hashed
    once. Problems (a mismatch, a missing or unreadable shard, a loaded file without a checksum)
    are collected as one line each, named by the shard."""

    def __init__(self, folder: str, files: Iterable[str], rank: int = 0, world: int = 1):
        from ..convert.discovery import INDEX_FILE
        from ..convert.verify import load_converted_index
        self.folder = folder
        self.problems: list = []
        digests = {}
        try:
            digests = (load_converted_index(folder).get("megamoe") or {}).get("sha256") or {}
        except ValueError as exc:
            self.problems.append(str(exc))
        names = sorted({os.path.basename(f) for f in files})
        if not digests and not self.problems:
            self.problems.append(f"{INDEX_FILE} has no megamoe sha256 checksums (not written by `vllm-megamoe "
                                 "convert`, or edited since)")
        elif digests:
            self.problems += [f"{n}: vLLM loads it but {INDEX_FILE} has no sha256 of it" for n in names
                              if n not in digests]
        sizes = {}
        for n in sorted(digests):
            path = os.path.join(folder, n)
            if os.path.isfile(path):
                sizes[n] = os.path.getsize(path)
            else:
                self.problems.append(f"{n}: has a sha256 in {INDEX_FILE} but is missing")
        self.shards = len(sizes)
        self.mine = assign_shards(sizes, world)[rank] if sizes else []
        self.bytes = sum(sizes[n] for n in self.mine)
        self._digests = digests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megamoe-sha256", daemon=True)
        self.seconds = 0.0

    def start(self) -> "ShardChecksums":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        from ..convert.safetensors_io import sha256_file
        from ..convert.verify import mismatch_problem
        for name in self.mine:
            try:
                actual = sha256_file(os.path.join(self.folder, name), stop=self._stop)
            except OSError as exc:
                self.problems.append(f"{name}: cannot be read to check its sha256 ({exc})")
                continue
            if actual is None:  # cancelled
                return
            if actual != self._digests[name]:
                self.problems.append(mismatch_problem(name, self._digests[name], actual))
        self.seconds = time.perf_counter() - self._t0

    def join(self) -> list:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        return self.problems

    def cancel(self) -> list:
        self._stop.set()
        return self.join()


def _worker_group() -> tuple:
    """(rank, world size, gloo group) of this worker among every worker of the deployment (vLLM's
    world group: all DP engines' TP x PP workers, on the one host megamoe runs on), else (0, 1, None)."""
    try:
        from vllm.distributed import parallel_state
        group = parallel_state.get_world_group()
        return group.rank_in_group, group.world_size, group.cpu_group
    except Exception:  # noqa: BLE001 - no distributed state (a test, one process): this worker checks all
        return 0, 1, None


def _gather(problems: list, world: int, group) -> list:
    if world == 1 or group is None:
        return list(problems)
    import torch.distributed as dist
    every = [None] * world
    dist.all_gather_object(every, list(problems), group=group)
    return list(dict.fromkeys(p for found in every for p in found))  # index problems: every worker's


def refusal(folder: str, problems: list) -> ValueError:
    return ValueError(
        f"megamoe: the converted checkpoint {folder} does not match the sha256 checksums of its index, so it is "
        f"not loaded: {'; '.join(problems)}. `vllm-megamoe verify {folder}` checks it without vLLM; "
        f"{VERIFY_ENV}=0 loads it unchecked")


class StreamingCheck:
    """The sha256 check of one load: started when vLLM has resolved the checkpoint's files (its
    loader's _prepare_weights, wrapped on the loader instance for the load), finished after it."""

    def __init__(self, model_loader, model_config):
        self.model_loader, self.model_config = model_loader, model_config
        self.check: Optional[ShardChecksums] = None
        self.rank, self.world, self.group = _worker_group()

    @contextlib.contextmanager
    def watching(self):
        prepare = getattr(self.model_loader, "_prepare_weights", None)
        if prepare is None:  # another loader layout: finish() checks the model directory instead
            yield
            return

        def prepare_and_check(*args, **kwargs):
            result = prepare(*args, **kwargs)
            if self.check is None:  # the first source is the checkpoint itself
                folder, files = result[0], result[1]
                self.check = ShardChecksums(folder, files, self.rank, self.world).start()
            return result

        self.model_loader._prepare_weights = prepare_and_check
        try:
            yield
        finally:
            del self.model_loader._prepare_weights

    def finish(self) -> None:
        """Wait for this worker's hashing, gather every worker's problems; raise when there is one."""
        if self.check is None:
            folder = getattr(self.model_config, "model", None)
            if not (isinstance(folder, str) and os.path.isdir(folder)):
                raise refusal(str(folder), [f"its files were not found to check them ({VERIFY_ENV}=0 skips the "
                                            "check)"])
            from ..convert.discovery import find_weight_files
            self.check = ShardChecksums(folder, find_weight_files(folder), self.rank, self.world).start()
        problems = _gather(self.check.join(), self.world, self.group)
        if problems:
            raise refusal(self.check.folder, problems)
        c = self.check
        logger.info("megamoe: sha256 of the %d shard(s) of the converted checkpoint match its index (this worker "
                    "hashed %d of them, %.2f GB, in %.1f s beside vLLM's reading; %s=0 skips the check)",
                    c.shards, len(c.mine), c.bytes / 1e9, c.seconds, VERIFY_ENV)

    def cancel(self, exc: BaseException) -> None:
        """The load failed: stop hashing; a mismatch found so far is the better error."""
        if self.check is not None:
            problems = self.check.cancel()
            if problems:
                raise refusal(self.check.folder, problems) from exc


def wrap_load_weights(original):
    """DefaultModelLoader.load_weights: route converted expert tensors through the loader above."""
    def load_weights(self, model, model_config):
        from . import runtime
        # Read from the checkpoint's config whatever the MoE backend: a converted checkpoint must
        # never reach another backend's loader (it would run kernel-layout weights wrongly).
        raw = getattr(getattr(model_config, "hf_config", None), "megamoe", None)
        if raw is None:
            return original(self, model, model_config)
        marker = runtime.parse_checkpoint_marker(raw)
        loader = ConvertedExpertLoader(model, marker)
        inner = model.load_weights

        def load_filtered(weights):
            loaded = inner(loader.take(weights))
            return None if loaded is None else set(loaded) | loader.loaded

        check = StreamingCheck(self, model_config) if runtime.settings().verify_checkpoint == "1" else None
        if check is None:
            logger.warning("megamoe: %s=0: loading the converted checkpoint without checking the sha256 "
                           "checksums of its shards", VERIFY_ENV)
        model.load_weights = load_filtered
        try:
            with check.watching() if check is not None else contextlib.nullcontext():
                result = original(self, model, model_config)
        except BaseException as exc:
            if check is not None:
                check.cancel(exc)
            raise
        finally:
            del model.load_weights
        if check is not None:
            check.finish()
        loader.log_summary()
        return result
    return load_weights
