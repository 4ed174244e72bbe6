"""Pipeline parallelism: one instance's layers split into contiguous stages, one process per
stage (and per tensor-parallel rank inside it), activations handed stage to stage
(stages.py: which layers each stage holds; activation_channel.py: the hand-over between two
processes; stage_step.py: one stage's part of a step). The processes are the tensor-parallel
executor's (engine/tensor_parallel/executor.py), which spawns TP x PP ranks."""
