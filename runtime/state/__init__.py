"""What a rank holds while it trains: the executor slot (the step executor with its optimizer, LR
scheduler and clipper), the moves of that state between executors (a re-plan, a migration, a leave)
and the checkpoints written from it.

slot.py is the slot (build, apply a plan, migrate, snapshot, land), transfer.py moves parameters
and optimizer state point to point between two executors, migration.py is FlexTP's lightweight
migration (the owner layout keeps the state, another layout computes), checkpointer.py owns the
background checkpoint saves and their process group, pretrained.py reads Hugging Face
``save_pretrained`` directories into what each rank holds and writes one from it. The Engine's step
loop asks the slot for a step's executor and optimizer and hands it plan changes; nothing else
writes into it.

Invariant: whatever the slot does to the executor (build, apply, migrate, land), the state the
rank holds after it is exactly the old plan's state redistributed, so training continues bit for
bit as the new plan would have run from the start.
"""
