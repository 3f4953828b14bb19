"""The attention wing: the engine, its planner, the flash launch shapes, the recorded
operations and the tuner."""
