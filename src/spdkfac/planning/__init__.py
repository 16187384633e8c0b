"""Pure planners returning frozen plans, shared by the run and the simulator: inverse
placement, factor fusion and its merge rules, the communication schedule, broadcast
grouping."""
