"""What the devices are and what work costs on them: the planner's models of hardware.

stage_cost.py records what a stage costs per sample (FLOPs and bytes from its Layers), which
cost_model.py prices as compute and communication from the spec's figures and memory.py, the one
memory model, as what a device holds of it (term by term, each term with its own fraction);
network.py is the one model of links (alpha-beta, host interfaces as serial resources, rings) that
the simulator, the resharding planner and the runtime's network emulation share; placement.py
decides which devices run which stage (virtual devices); profile.py holds what ``whalelike
profile`` measured, speed_curves.py its time-per-sample curves, and measured_speeds.py turns a
profile into the rates and links the cost model reads. Invariant: one figure per device and link,
read from the cluster spec or measured by a profile, never from the emulation block (the emulator
is hidden truth).
"""
