"""What a lean CUDA graph does when a replay would be unsafe (a static input that moved, an output still
referenced), as a mixin of :class:`~te_passes.cudagraphs.lean.LeanCUDAGraph`: a moved saved tensor
copied back into the forward's static output, an output cloned on return from now on, or this call run
without the CUDA graph; each decision is a record (``CompileReport.cudagraphs``)."""

from __future__ import annotations

from te_passes.cudagraphs.engine import ALIAS, clone_kind, owner, use_count


class ReplayHazards:
    """Hazard decisions of a lean graph; mixed into ``LeanCUDAGraph`` (uses its ``_static_idx``,
    ``_static_ptrs``, ``_static_inputs``, ``_plan``, ``_own``, ``_pool``, ``_check_cache``,
    ``_rec``, ``stats``)."""

    def _fix_moved(self, inputs: list, ptrs: list[int]) -> bool:
        """Static inputs at a new address: copy each into the old one when the old one is a
        lean graph's static output nobody references (its forward ran without the CUDA graph)
        and the graph does not mutate it; else ``False`` (this call runs without the graph)."""
        fixes = []
        for i, p, q in zip(self._static_idx, ptrs, self._static_ptrs):
            if p == q:
                continue
            own = owner(q)
            ok = own is not None and i not in self._mutated
            if ok:
                runner, cdata, _ = own
                ok = all(use_count(it[0]) <= it[1] for it in runner._own if it[0] == cdata)
            if not ok:
                why = ("a saved tensor that is an output of a lean graph still referenced" if own is not None
                       else "a parameter / buffer re-assigned, or a saved tensor produced outside a lean graph")
                self._rec.event(self.name, "eager", f"static input {i} moved ({why}): this call runs without "
                                "the CUDA graph", input=i)
                return False
            fixes.append(i)
        for i in fixes:
            self._static_inputs[i].copy_(inputs[i])
            self.stats["copies"] += 1
        if fixes:
            self._rec.event(self.name, "copied", "saved tensors from a forward that ran without its CUDA graph "
                            "copied into the forward's static outputs", inputs=len(fixes))
        return True

    def _resolve_held(self) -> bool:
        """A use count differs from its baseline: find what is referenced and decide. Returns
        ``True`` when nothing is (counts only dropped: baselines re-taken) and the replay may go on."""
        held = []
        for member, item in self._check_cache[3]:
            now = use_count(item[0])
            if now > item[1]:
                held.append((member, item))
        if not held:
            for _, item in self._check_cache[3]:
                item[1] = use_count(item[0])
            self._pool.version += 1
            return True
        for member, item in held:
            j = item[2]
            kind, o = member._plan[j]
            if member.is_backward:
                if kind == ALIAS:
                    member._plan[j] = (clone_kind(o), o)
                where = ("its next replay" if member is self
                         else f"a replay of {self.name} (captured before it in the pool)")
                self._rec.event(member.name, "clone", f"backward output {j} still referenced at {where} "
                                "(kept as .grad: gradient accumulation, or zero_grad after forward): "
                                "cloned on return from now on", output=j)
                whose = "its previous replay" if member is self else member.name
                self._rec.event(self.name, "eager", f"an output of {whose} is still referenced: this call "
                                "runs without the CUDA graph")
            elif member is self and self._backward_ran_since_replay():
                if kind == ALIAS:
                    member._plan[j] = (clone_kind(o), o)
                self._rec.event(self.name, "clone", f"output {j} still referenced after its backward ran "
                                "(retain_graph, or a kept view): cloned on return from now on", output=j)
                self._rec.event(self.name, "eager", "an output of the previous replay is still referenced: this "
                                "call runs without the CUDA graph")
            elif member is self:
                self._rec.event(self.name, "eager", "saved tensors of the previous replay are still referenced "
                                "and its backward has not run (a second forward before its backward: gradient "
                                "accumulation over pending graphs, pipeline schedules): this call runs without "
                                "the CUDA graph", output=j)
            else:
                self._rec.event(self.name, "eager", f"output {j} of {member.name} (captured later in the same "
                                "pool) is still referenced: this call runs without the CUDA graph", output=j)
        return False

    def _backward_ran_since_replay(self) -> bool:
        return any(m.is_backward and m._last_call_seq > self._last_replay_seq for m in self._pool.members)
