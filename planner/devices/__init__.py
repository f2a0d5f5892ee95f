"""What the devices are and what work costs on them: the planner's models of hardware.

cost_model.py prices compute and communication from the spec's figures; memory.py is the one
memory model (what a device holds of a stage, term by term, each term with its own fraction);
network.py is the one model of links (alpha-beta, host interfaces as serial resources, rings) that
the simulator, the resharding planner and the runtime's network emulation share; placement.py
decides which devices run which stage (virtual devices). Invariant: one figure per device and
link, read from the cluster spec, never from the emulation block (the emulator is hidden truth).
"""
