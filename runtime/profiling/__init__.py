"""Online profiling (Poplar): measure what each device of a cluster really does for one model.

run.py runs it under torchrun, one rank per device, all at once (``profile_cluster``, behind
``whalelike profile``); steps.py runs one training step of the model cut into units (TaskGraphs
or Layers), timing each unit's forward and backward as the runtime's compute segments and asking
whether a whole step fits in memory; search.py is Poplar's Algorithm 1, the largest batch that
fits; links.py times transfers and fits each link's latency and bandwidth; cache.py keeps what a
device kind measured for the next run; progress.py draws the bar on rank 0. The result is a
``planner.devices.profile.Profile``, plain data the planner reads.

Why not estimate from spec sheets or ``torch.profiler``: the planner already has the spec sheets,
and they are what is wrong (efficiency at small batches, memory bandwidth, low-precision rates);
kernel profilers time kernels, not the segments the emulator pads, so they would measure the CPU
under an emulated cluster and a GPU otherwise. Measuring through the runtime's public paths
(``Emulator.segment``, the emulated network's stamps, ``MemoryMeter`` and ``check_capacity``, a
real ``torch.OutOfMemoryError``) measures whatever the hardware, emulated or real, does.

Invariant: profiling only measures: it never changes the model's parameters (the optimizer runs
at learning rate 0), reads no emulation figure (only the emulator does), and every rank ends with
the same Profile.
"""
from runtime.profiling.run import DEFAULT_CAP, DeviceMeasurement, ProfilingError, profile_cluster

__all__ = ["DEFAULT_CAP", "DeviceMeasurement", "ProfilingError", "profile_cluster"]
