"""In-process recovery: a lost rank is replaced while the surviving ranks stay alive.

When a rank dies (SIGKILL, a crash, the hang supervisor's kill), its peers notice inside the
collective they are in (gloo: "Connection closed by peer" within milliseconds). With
``[recovery] in_process`` they do not exit. What happens, in order:

1. **The survivors abandon the step.** The Guard call the failure surfaced in (``run_step``,
   ``should_step``, the stop check in ``step_end``) records it and returns; ``should_step``
   returns ``False`` so ``optimizer.step()`` is not applied, and ``step_end`` starts recovery.
2. **The launcher replaces the rank** (:mod:`trainguard.launcher.replace`): it starts a
   replacement process with the lost rank's number and environment and publishes a new
   *generation* (its number, the replaced ranks, the address of a fresh store for its groups) in
   the recovery store it hosts (:mod:`.protocol`).
3. **Everyone meets in the new generation** (:mod:`.regroup`): the survivors destroy their process
   groups and create the new default group on the generation's store; DDP gets a fresh reducer on
   it; trainguard's own groups (checkpoint writer, liveness ping) are created again, in the same
   order as the replacement creates them while its script starts.
4. **State comes from the survivors' memory**: the lowest surviving rank broadcasts the step,
   the model and the optimizer; the replacement reads the lost rank's own state at the last step
   boundary (data position, RNG streams, micro-batch size, instability statistics) from the node-
   local file the lost rank kept current (:mod:`.boundary`). The survivors restore theirs from
   memory, so the interrupted step is done again from the same batch and random numbers: no
   completed step is lost, nothing is read from the checkpoint store, and the result stays bitwise
   identical to a run without the failure.

Anything the protocol cannot cover ends in the old path: a survivor that waits longer than
``[recovery] timeout`` for the new generation re-raises the original error and exits, and the
launcher restarts the whole group from the newest checkpoint (``recovery_fallback``).
"""
