"""The prepared GPU check (`bash scripts/gpu_check.sh`): the CUDA paths of training and weight sync.

Every check runs twice: once on CPU in a child process with CUDA hidden (the reference, which also
writes the saved rollouts), then on the device (CUDA, or the CPU again with `--cpu`), and the two
are compared within the tolerances in `report.TOLERANCES`. It needs only torch, transformers, peft,
numpy, safetensors and tokenizers; `env.BLOCKED` lists packages the GPU machine lacks, which are made
unimportable here so that a hidden dependency fails on CPU first.
"""
