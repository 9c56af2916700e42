#!/usr/bin/env bash
# The seed's GRPO-on-GSM8K run against the server started by run_vllm_server.sh (127.0.0.1:8001),
# sized for a CPU machine. Data: `skylift data gsm8k --out ~/data/gsm8k --local-path DIR`.
# Set WANDB_API_KEY and add trainer.logger="['console','wandb']" to log to Weights & Biases.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DATA="${DATA:-$HOME/data/gsm8k}"
export HF_HUB_OFFLINE=1 GLOO_SOCKET_IFNAME=lo

.venv/bin/python -m skylift.entrypoints.main_base \
    generator.run_engines_locally=False \
    generator.remote_inference_engine_urls="['127.0.0.1:8001']" \
    generator.override_existing_update_group=True \
    generator.sampling_params.temperature=0.6 \
    generator.sampling_params.top_p=0.95 \
    data.train_data="['$DATA/train.parquet']" \
    data.val_data="['$DATA/validation.parquet']" \
    data.max_val_samples=64 \
    trainer.policy.model.path="smollm2-135m-instruct" \
    trainer.algorithm.advantage_estimator="grpo" \
    trainer.placement.colocate_all=False \
    trainer.placement.policy_num_gpus_per_node=1 \
    trainer.placement.ref_num_gpus_per_node=1 \
    trainer.train_batch_size=8 \
    trainer.policy_mini_batch_size=8 \
    trainer.micro_forward_batch_size_per_gpu=8 \
    trainer.micro_train_batch_size_per_gpu=8 \
    trainer.eval_batch_size=64 \
    trainer.eval_before_train=true \
    trainer.eval_interval=5 \
    trainer.gradient_checkpointing=false \
    generator.n_samples_per_prompt=4 \
    generator.max_generate_length=256 \
    trainer.policy.optimizer_config.lr=1e-6 \
    trainer.max_steps=20 \
    trainer.ckpt_interval=10 \
    trainer.run_name=gsm8k_remote \
    "$@"
