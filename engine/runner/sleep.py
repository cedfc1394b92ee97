"""The sleep-mode and weight-update half of :class:`engine.runner.model_runner.ModelRunner` (a mixin):
``sleep`` frees the device through the owner, ``wake`` brings the parts back, ``update_weights*``
write a validated checkpoint into the weights' storage. engine/serving/sleep.py drives it.

With tensor parallelism the driver's calls reach every rank (engine/tp/control.py): each rank
runs the ``_local`` part on its own shard; an update is checked in full here, on the driver,
before any rank hears of it, then its bytes go to every rank over the process group
(engine/tp/update.py: ``receive_weights`` is a worker's side).

It uses the runner's ``_owner``, ``device``, ``dtype``, ``config``, ``model_config``,
``speculator``, ``weight_format``, ``weights_source``, ``asleep``/``sleep_level``/
``sleep_timings``, ``loaded``, ``_build_stack()``, ``_capture_mixed()`` and ``_pack()``.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Sequence

import torch

from engine.errors import BadRequestError, CheckpointError
from engine.loader.checkpoint import create_model, fill_model, resolve_source
from engine.memory.owner import Resource as R
from engine.memory.weights import (NamedTensors, check_architecture, copy_into, validated,
                                   weight_spec)
from engine.model.cpu_weights import is_packed, pack_model, packed_types

log = logging.getLogger("enginecore.runner")


class RunnerSleep:
    # -- sleep mode (engine/serving/sleep.py drives it) ----------------------------------------------
    def sleep(self, level: int, tags: Sequence[str] = ("weights", "kv_cache")) -> int:
        """Free the device, with no request in flight: the speculator, the grammar bitmask, CUDA
        graphs, model state and KV cache are released through the owner (reverse creation order); the weights are
        offloaded to host memory (level 1; page-locked on CUDA) or released too (level 2).
        ``tags=("kv_cache",)``: the weights stay on the device (the speculator is offloaded).
        Returns the bytes kept in host memory (on every rank)."""
        if level not in (1, 2):
            raise BadRequestError(f"sleep level must be 1 or 2, not {level!r}")
        if self._tp is None:
            return self._sleep_local(level, tags)
        return self._tp.sleep_all(level, tags, lambda: self._sleep_local(level, tags))

    def _sleep_local(self, level: int, tags: Sequence[str]) -> int:
        if "weights" not in tags:
            level = 1  # what a level means is what happens to the weights: they stay
        pin, own, held = self.device.type == "cuda", self._owner, 0
        if pin:
            torch.cuda.synchronize(self.device)
        t = [time.perf_counter()]
        if R.SPECULATOR in own:
            if level == 1:
                held += own.offload(R.SPECULATOR, pin)
            else:
                own.release(R.SPECULATOR)
        for name in (R.GRAMMAR_BITMASK, R.CUDA_GRAPHS, R.MODEL_STATE, R.KV_CACHE):
            if name in own:
                own.release(name)
        t.append(time.perf_counter())
        if R.WEIGHTS in own and "weights" in tags:
            if level == 1:
                held += own.offload(R.WEIGHTS, pin)
            else:
                own.release(R.WEIGHTS)
        t.append(time.perf_counter())
        own.empty_device_cache()
        t.append(time.perf_counter())
        self.sleep_timings = {"release_s": t[1] - t[0], "offload_s": t[2] - t[1],
                              "empty_cache_s": t[3] - t[2]}
        self.asleep, self.sleep_level = tuple(t for t in ("weights", "kv_cache") if t in tags), level
        log.info("asleep (%s) at level %d: %.1f MiB kept in host memory", ", ".join(self.asleep),
                 level, held / 2**20)
        return held

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring back the parts ``tags`` name: the weights (copied back, or reloaded from
        ``weights_source`` after level 2), the KV cache with model state and graphs (graphs
        are captured again on first use). The speculator comes back with the last part. A wake
        that fails releases what it brought back (asleep again, every part) before it raises --
        on every rank when one of them fails."""
        if self._tp is None:
            return self._wake_local(tags)
        level = self._rollback_level()
        self._tp.wake_all(tags, lambda: self._wake_local(tags), level,
                          lambda: self._sleep_local(level, ("weights", "kv_cache")))

    def _rollback_level(self) -> int:
        return 1 if self.weights_source is None else max(1, self.sleep_level)

    def _wake_local(self, tags: Sequence[str]) -> None:
        t0, self.sleep_timings = time.perf_counter(), {}
        try:
            if "weights" in tags and "weights" in self.asleep:
                if R.WEIGHTS in self._owner:
                    self._owner.restore(R.WEIGHTS)
                else:
                    self._reload_weights()
                self.asleep = tuple(t for t in self.asleep if t != "weights")
                if "kv_cache" not in self.asleep:  # the stack woke first: its graphs now
                    self._capture_mixed()
                t0 = self._lap("weights_s", t0)
            if "kv_cache" in tags and "kv_cache" in self.asleep:
                self._build_stack()
                self.asleep = tuple(t for t in self.asleep if t != "kv_cache")
                t0 = self._lap("kv_cache_s", t0)
            if not self.asleep and self.speculator is not None:
                if R.SPECULATOR in self._owner:
                    self._owner.restore(R.SPECULATOR)
                self.speculator.wake()
                self._lap("speculator_s", t0)
        except BaseException as exc:
            self._sleep_local(self._rollback_level(), ("weights", "kv_cache"))
            traceback.clear_frames(exc.__traceback__)
            raise
        if not self.asleep:
            self.sleep_level = 0

    def _lap(self, part: str, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.sleep_timings = {**self.sleep_timings, part: now - t0}
        return now

    def _reload_weights(self) -> None:
        if self.weights_source is None:
            raise BadRequestError(
                "the weights were discarded (sleep level 2) and came from "
                "update_weights_from_tensors: load them again with update_weights* first")
        src = self.weights_source
        cfg, tensors, _tok = resolve_source(src, self.config.revision if src == self.config.model else None)
        check_architecture(self.model_config, cfg, src)
        if self._tp is None:
            model = self._new_weights()
        else:  # this rank's slices, as at load
            from engine.tp.load import create_shard

            model, tensors = create_shard(self, self.model_config, tensors)
        fill_model(model, tensors, self.config.seed, self.weights_source)
        if self._tp is None:
            self._pack(model, tensors)

    def _new_weights(self):
        """Weights of this rank's shapes, adopted, uninitialised (to be filled or written)."""
        if self._tp is None:
            return self._owner.adopt(R.WEIGHTS, create_model(
                self.model_config, self.device, self.dtype, self.switches,
                self.config.deterministic))
        from engine.tp.load import create_shard

        return create_shard(self, self.model_config, None)[0]

    def update_weights(self, source: str) -> None:
        """Load checkpoint ``source`` (same architecture) into the weights' storage, on the
        device or offloaded; every tensor is checked (names, shapes, floating dtypes) before
        the first copy, so a refused checkpoint leaves the old weights as they were. After a
        level-2 sleep the weights are allocated on the device for it."""
        if source.startswith("random:"):
            raise BadRequestError(f"{source!r}: random presets carry no weights to load")
        try:
            cfg, tensors, _tok = resolve_source(source)
            check_architecture(self.model_config, cfg, source)
            spec = weight_spec(self.model_config, self.dtype)
            new = validated(spec, tensors(), self.model_config, source, exact_dtype=False)
        except OSError as exc:  # a name too long, no permission, a read error: the caller's path
            raise CheckpointError(source, f"cannot read it: {exc}") from None
        self._write_weights(new, source)

    def update_weights_from_tensors(self, named: NamedTensors, partial: bool = False) -> None:
        """As :meth:`update_weights`, from ``(name, tensor)`` pairs of the weights' shapes and
        dtype (any device): all of them, or with ``partial`` any subset (written in place: CUDA
        graphs and fused views stay valid); a later level-2 sleep cannot reload them."""
        self._write_weights(self.check_weights(named, partial), None)

    def check_weights(self, named: NamedTensors, partial: bool = True) -> dict:
        """``named`` validated as an update (names, shapes, dtypes; tensors on the meta device
        check a transfer's plan before anything moves); raises ``BadRequestError``."""
        spec = weight_spec(self.model_config, self.dtype)
        new = validated(spec, named, self.model_config, "tensors", exact_dtype=True,
                        partial=partial)
        model = self._owner.get(R.WEIGHTS)
        if partial and len(new) < len(spec) and model is None:
            raise BadRequestError("update_weights: the weights were discarded (sleep level 2); "
                                  "a full set of weights is needed")
        if partial and len(new) < len(spec) and is_packed(model):
            raise BadRequestError("update_weights: this model's CPU weights are packed "
                                  f"({self.weight_format}); they take a full set of weights only")
        return new

    def weight_info(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every updatable parameter: (name as ``update_weights_*`` takes it, shape, dtype)."""
        spec = weight_spec(self.model_config, self.dtype)
        return [(n, shape, str(dtype).removeprefix("torch.")) for n, (shape, dtype) in spec.items()]

    def _write_weights(self, tensors, source) -> None:
        """``tensors`` (validated, full shapes) into the weights; ``source``: where they came
        from (a later level-2 wake reloads it), None for tensors."""
        if not self.loaded and not self.asleep:
            raise BadRequestError("update_weights needs a loaded model")
        if self._tp is not None:  # every rank's slices (a TP rank's weights are never packed)
            from engine.tp.update import bucket_bytes, send

            tp, per_rank = self._tp, bucket_bytes(self._tp.world)
            tp.update_all(list(tensors), [list(t.shape) for t in tensors.values()], per_rank,
                          source, lambda: send(tensors, self.dtype, self.device, tp.world,
                                               self._write_local, per_rank))
            self.weights_source = source
            log.info("weights updated (%d tensors, on %d ranks)", len(tensors), tp.world)
            return
        model = self._owner.get(R.WEIGHTS)
        if model is not None and is_packed(model):
            # packed kernels' layouts cannot be written in place: new float weights, repacked
            # like the old ones, then the old ones released (the new ones are owned first)
            fresh = create_model(self.model_config, self.device, self.dtype, self.switches,
                                 self.config.deterministic)
            copy_into(fresh, tensors)
            pack_model(fresh, self.weight_format, packed_types(model))
            self._owner.release(R.WEIGHTS)
            self._owner.adopt(R.WEIGHTS, fresh)
            del fresh
        else:
            self._write_local(tensors)
        self.weights_source = source
        log.info("weights updated (%d tensors)", len(tensors))

    def _write_local(self, tensors) -> None:
        """Float weights of this rank's shapes, written in place (allocated first if a level-2
        sleep discarded them: the written set is then a full one, ``check_weights``)."""
        model = self._owner.get(R.WEIGHTS)
        woke = model is None
        if woke:  # discarded by a level-2 sleep: these are the weights now
            model = self._new_weights()
            self.asleep = tuple(t for t in self.asleep if t != "weights")
        copy_into(model, tensors)
        if woke and "kv_cache" not in self.asleep:  # the stack woke first: its graphs now
            self._capture_mixed()

    def resources(self) -> list[str]:
        """What the owner holds now (on the device, or offloaded by a sleep)."""
        return self._owner.names()

    def receive_weights(self, names: list[str], shapes: list[list[int]], bucket_bytes: int,
                        source) -> int:
        """A tensor-parallel worker's side of an update the driver checked and sends
        (engine/tp/update.py): this rank's slices written as each bucket arrives."""
        from engine.tp.update import receive

        n = receive(names, shapes, self.dtype, self.device, self._tp.rank, self._tp.world,
                    self._write_local, bucket_bytes)
        self.weights_source = source
        return n
