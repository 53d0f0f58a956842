"""The lifecycle: a replica (one supervised slot), its incarnations (processes), its worker and
liveness, the group owners that decide after an exit, the fleet and its rollouts.
Only this package writes a replica's fields."""
