"""The one table of what becomes of each TRL / transformers.Trainer / accelerate key.

Each key has a Rule: `mapped` (same meaning under a recipe key), `changed` (a recipe key that
gives the original's behaviour through a different quantity, e.g. a global batch), `dropped`
(no effect on the trained weights, with the reason) or `refused` (accord cannot do it: the
reason and the nearest supported value; a refused key left at its TRL default is dropped, since
the default is accord's behaviour too). `how` names a conversion in `conversions.CONVERSIONS`.
docs/coming-from-trl.md's table is generated from here.
"""

from __future__ import annotations

from dataclasses import dataclass


class Refused(Exception):
    """A value accord cannot run: why, and what to use instead (raised by a conversion)."""

    def __init__(self, reason: str, nearest: str):
        super().__init__(reason)
        self.reason, self.nearest = reason, nearest


@dataclass(frozen=True)
class Rule:
    decision: str  # mapped | changed | dropped | refused
    target: str = ""  # the recipe key it sets ("" for none)
    how: str = ""  # a conversion in conversions.CONVERSIONS ("": the value as it is)
    note: str = ""  # changed: how the value is computed; dropped/refused: why
    nearest: str = ""  # refused: what to use instead


def mapped(target: str, how: str = "", note: str = "") -> Rule:
    return Rule("mapped", target, how, note)


def changed(target: str, how: str, note: str) -> Rule:
    return Rule("changed", target, how, note)


def dropped(note: str) -> Rule:
    return Rule("dropped", note=note)


def refused(note: str, nearest: str) -> Rule:
    return Rule("refused", note=note, nearest=nearest)


def _each(names: str, rule: Rule) -> dict[str, Rule]:
    return {name: rule for name in names.split()}


_HUB = dropped("accord does not upload: push output.dir/final yourself (hf upload)")
_LOG = dropped("logging only; accord writes metrics.jsonl and TensorBoard events (observe section for trackers)")
_EVAL_ONLY = dropped("evaluation bookkeeping; accord evaluates the held-out loss at train.eval_every")
_LOADER = dropped("data loading mechanics; accord reads memory-mapped token shards in one seeded global order")
_DDP = dropped("DDP tuning; accord's engine sets up torch.distributed itself")
_SPEED = dropped("speed only, no effect on the updates")
_RUN = dropped("how the original was started; accord's launcher decides (accord train --processes/--devices)")
_SAVE = dropped("accord writes a checkpoint and final/ (a save_pretrained folder) itself")
_VLLM = dropped("vLLM serving; accord samples with the model being trained (transformers generate)")
_DATASET = dropped("dataset preprocessing mechanics; accord tokenizes once into its cache (data.prepare_workers)")
_QUANT = refused("quantized (QLoRA) training is not supported by accord", "train LoRA on the full-precision model")


RULES: dict[str, Rule] = {
    # ---------------------------------------------------------------- model (ModelConfig)
    "model_name_or_path": mapped("model.path"),
    "model_revision": mapped("model.revision", how="revision"),
    "dtype": changed(
        "engine.precision", "dtype", "weights' load dtype: bf16/fp16 become mixed precision, fp32 master weights"
    ),
    "attn_implementation": mapped("model.attn_implementation"),
    "trust_remote_code": mapped("model.trust_remote_code"),
    "model_init_kwargs": refused("extra from_pretrained arguments have no recipe key", "model.* keys"),
    "use_peft": changed("lora", "lora", "use_peft: true becomes a lora section (r, alpha, dropout, target_modules)"),
    "lora_r": mapped("lora.r"),
    "lora_alpha": mapped("lora.alpha"),
    "lora_dropout": mapped("lora.dropout"),
    "lora_target_modules": mapped("lora.target_modules", how="lora_targets"),
    "lora_target_parameters": refused("adapters on raw parameters are not supported", "lora.target_modules"),
    "lora_modules_to_save": refused("fully trained extra modules beside LoRA are not supported", "leave unset"),
    "lora_task_type": dropped("accord picks the peft task type from the task"),
    "use_rslora": refused("rank-stabilised LoRA scaling is not supported", "use_rslora: false"),
    "use_dora": refused("DoRA is not supported", "use_dora: false"),
    "load_in_8bit": _QUANT,
    "load_in_4bit": _QUANT,
    "bnb_4bit_quant_type": _QUANT,
    "use_bnb_nested_quant": _QUANT,
    "bnb_4bit_quant_storage": _QUANT,
    # ---------------------------------------------------------------- data (ScriptArguments, mixtures)
    "dataset_name": mapped("data.train", how="dataset"),
    "dataset_config": mapped("data.train.config", how="source_key"),
    "dataset_train_split": mapped("data.train.split", how="source_key"),
    "dataset_test_split": mapped("data.eval.split", how="eval_split"),
    "dataset_streaming": mapped("data.train.streaming", how="source_key"),
    "streaming": mapped("data.train.streaming", how="source_key"),
    "datasets": changed(
        "data.train",
        "mixture",
        "TRL's fraction is each dataset's share of the mixture, the mixture as large as it can be without repeating "
        "rows: it becomes the rows kept (count) of local JSONL files; other sources with fraction are refused. "
        "A builder path (json, csv, parquet, text) with one data_files file becomes that file",
    ),
    "test_split_size": mapped(
        "data.eval_fraction",
        how="test_split",
        note="train_test_split's test_size: a fraction of the mixed rows held out (seeded); a row count is refused",
    ),
    "ignore_bias_buffers": dropped("a DDP workaround for models with boolean buffers; accord's DDP does not need it"),
    "dataset_text_field": mapped("data.train.fields", how="text_field"),
    "dataset_kwargs": refused("extra load_dataset arguments have no recipe key", "data.train source keys"),
    "dataset_num_proc": mapped("data.prepare_workers"),
    "max_length": mapped("data.max_length", how="max_length"),
    "truncation_mode": mapped("data.truncation", how="truncation"),
    "shuffle_dataset": dropped(
        "a pre-shuffle of the rows; accord's global order is seeded and shuffled (data.shuffle)"
    ),
    "packing": mapped("data.packing"),
    "packing_strategy": changed(
        "data.packing",
        "packing_strategy",
        "bfd (documents kept apart) is accord's packing; wrapped (rows cut across documents) is refused",
    ),
    "padding_free": dropped("accord packs without padding when data.packing is on, and pads otherwise: same loss"),
    "pad_to_multiple_of": _SPEED,
    "eval_packing": dropped("accord packs held-out data as it packs training data"),
    "completion_only_loss": changed(
        "data.completion_only_loss",
        "completion_only_loss",
        "TRL's default (None) trains prompt/completion rows on the completion only, and text rows on every token",
    ),
    "assistant_only_loss": changed(
        "data.completion_only_loss",
        "assistant_only_loss",
        "TRL's default (false) trains chat rows on EVERY token (user turns too); accord's default only the "
        "assistant's: the import writes data.completion_only_loss=false for chat data unless this is true",
    ),
    "chat_template_path": refused("a separate chat template file has no recipe key", "a tokenizer folder with it"),
    "eos_token": refused(
        "a replacement EOS token has no recipe key", "model.tokenizer: a tokenizer folder whose eos_token it is"
    ),
    "pad_token": refused("a replacement pad token has no recipe key", "model.tokenizer: a folder with it"),
    # ---------------------------------------------------------------- batch, length, optimizer, schedule
    "per_device_train_batch_size": changed(
        "batch.micro_batch_size",
        "batch",
        "micro_batch_size kept; global_batch_size = per_device_train_batch_size × gradient_accumulation_steps × "
        "devices × nodes (accord derives the accumulation for its own world)",
    ),
    "gradient_accumulation_steps": changed(
        "batch.global_batch_size", "batch", "part of the global batch (see per_device_train_batch_size)"
    ),
    "per_device_eval_batch_size": mapped("train.eval_micro_batch_size"),
    "auto_find_batch_size": refused(
        "a batch that changes at run time breaks hardware invariance", "a fixed per_device_train_batch_size"
    ),
    "learning_rate": mapped("optim.lr"),
    "weight_decay": mapped("optim.weight_decay"),
    "adam_beta1": mapped("optim.betas", how="beta1"),
    "adam_beta2": mapped("optim.betas", how="beta2"),
    "adam_epsilon": mapped("optim.eps"),
    "max_grad_norm": mapped("optim.max_grad_norm", how="grad_norm"),
    "optim": changed("", "optimizer", "accord runs torch's AdamW: adamw_torch(_fused) and adamw_hf are the same"),
    "optim_args": refused("optimizer arguments beyond lr/betas/eps/weight_decay", "leave unset"),
    "optim_target_modules": refused("GaLore-style optimizer targets are not supported", "leave unset"),
    "lr_scheduler_type": mapped("optim.schedule", how="schedule"),
    "lr_scheduler_kwargs": refused("schedule arguments (cycles, minimum lr) are not supported", "leave unset"),
    "warmup_steps": changed(
        "optim.warmup_steps",
        "warmup",
        "a value < 1 is a ratio: ceil(ratio × total steps), total = max_steps, or with num_train_epochs "
        "epochs × ceil(rows / global batch) of a local JSONL file",
    ),
    "warmup_ratio": changed("optim.warmup_steps", "warmup", "older name: ceil(ratio × total steps) as warmup_steps"),
    "max_steps": mapped("train.max_steps", how="max_steps"),
    "num_train_epochs": mapped("train.epochs", how="epochs"),
    "seed": mapped("seed"),
    "data_seed": refused("a separate data-order seed is not supported (seed orders the data)", "leave unset"),
    "label_smoothing_factor": refused("label smoothing of the token loss is not supported", "0"),
    "neftune_noise_alpha": refused("NEFTune embedding noise is not supported", "leave unset"),
    "loss_type": mapped("dpo.loss_type", how="loss_type"),
    "average_tokens_across_devices": changed(
        "",
        "average_tokens",
        "accord always divides by the target tokens of the whole global batch (TRL's default true does too)",
    ),
    "router_aux_loss_coef": refused("MoE router auxiliary loss weight has no recipe key", "leave at default"),
    "train_sampling_strategy": refused("only a seeded random (or file) order is supported", "random"),
    "disable_dropout": changed(
        "",
        "disable_dropout",
        "TRL turns dropout off in the model; accord trains the model's config as it is: set its dropout "
        "probabilities to 0 in the model folder's config for the same behaviour",
    ),
    # ---------------------------------------------------------------- precision, memory, engine
    "bf16": mapped("engine.precision", how="bf16", note="TRL's configs default bf16 to true unless fp16"),
    "fp16": mapped("engine.precision", how="fp16"),
    "tf32": _SPEED,
    "bf16_full_eval": refused("evaluation in pure bf16 is not supported", "false"),
    "fp16_full_eval": refused("evaluation in pure fp16 is not supported", "false"),
    "gradient_checkpointing": mapped("engine.activation_checkpointing", how="flag"),
    "gradient_checkpointing_kwargs": dropped("accord checkpoints each decoder layer non-reentrantly"),
    "activation_checkpointing": mapped("engine.activation_checkpointing", how="flag"),
    "activation_checkpointing_kwargs": dropped("accord checkpoints each decoder layer non-reentrantly"),
    "activation_offloading": changed("engine.activation_checkpointing", "offload", "true becomes offload"),
    "enable_jit_checkpoint": dropped("accord checkpoints on SIGTERM/SIGUSR1 itself"),
    "deepspeed": changed("engine.strategy", "deepspeed_file", "the DeepSpeed JSON is read: zero stage and offload"),
    "fsdp": changed("engine.strategy", "fsdp", "full_shard (with or without auto_wrap) becomes engine.strategy=fsdp"),
    "fsdp_config": changed("engine.strategy", "fsdp_config", "activation checkpointing is kept, the rest derived"),
    "parallelism_config": refused("accelerate's parallelism_config as a Python object", "an accelerate config file"),
    "accelerator_config": dropped("accord builds no Accelerator"),
    "torch_compile": mapped("engine.compile"),
    "torch_compile_backend": _SPEED,
    "torch_compile_mode": _SPEED,
    "use_liger_kernel": dropped("accord's chunked loss (train.loss_chunk_size) saves the logits' memory instead"),
    "liger_kernel_config": dropped("accord's chunked loss (train.loss_chunk_size) saves the logits' memory instead"),
    "torch_empty_cache_steps": _SPEED,
    "use_cpu": changed("engine.device", "use_cpu", "true becomes engine.device=cpu"),
    "use_cache": dropped("the KV cache is off in training either way"),
    "ddp_backend": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_find_unused_parameters": _DDP,
    "ddp_static_graph": _DDP,
    "ddp_timeout": _DDP,
    "local_rank": _RUN,
    "debug": _RUN,
    "full_determinism": dropped("accord's runs are seeded and ordered deterministically by design"),
    "skip_memory_metrics": _LOG,
    # ---------------------------------------------------------------- evaluation, logging, saving
    "eval_strategy": changed("train.eval_every", "eval_strategy", "steps uses eval_steps; epoch is refused"),
    "evaluation_strategy": changed("train.eval_every", "eval_strategy", "older name of eval_strategy"),
    "eval_steps": mapped("train.eval_every", how="eval_steps"),
    "eval_on_start": mapped("train.eval_on_start"),
    "eval_delay": refused("a delayed first evaluation is not supported", "leave unset"),
    "do_eval": _EVAL_ONLY,
    "do_train": _RUN,
    "do_predict": _RUN,
    "eval_accumulation_steps": _EVAL_ONLY,
    "eval_do_concat_batches": _EVAL_ONLY,
    "eval_use_gather_object": _EVAL_ONLY,
    "batch_eval_metrics": _EVAL_ONLY,
    "include_for_metrics": _EVAL_ONLY,
    "prediction_loss_only": _EVAL_ONLY,
    "label_names": _EVAL_ONLY,
    "metric_for_best_model": refused("keeping the best checkpoint is not supported (the last ones are kept)", "unset"),
    "greater_is_better": _EVAL_ONLY,
    "load_best_model_at_end": refused("the best checkpoint is not reloaded; final/ is the last step", "false"),
    "logging_steps": mapped("train.log_every", how="log_every"),
    "logging_strategy": _LOG,
    "logging_first_step": _LOG,
    "logging_nan_inf_filter": dropped("accord's train.on_nonfinite decides what a NaN loss does"),
    "logging_dir": _LOG,
    "log_level": _LOG,
    "log_level_replica": _LOG,
    "log_on_each_node": _LOG,
    "disable_tqdm": _LOG,
    "report_to": _LOG,
    "run_name": _LOG,
    "project": _LOG,
    "trackio_space_id": _LOG,
    "trackio_bucket_id": _LOG,
    "trackio_static_space_id": _LOG,
    "include_num_input_tokens_seen": _LOG,
    "output_dir": mapped("output.dir"),
    "overwrite_output_dir": mapped("output.overwrite"),
    "save_strategy": changed("checkpoint.every_steps", "save_strategy", "steps uses save_steps; epoch is refused"),
    "save_steps": mapped("checkpoint.every_steps", how="save_steps"),
    "save_total_limit": mapped("checkpoint.keep_last"),
    "save_only_model": _SAVE,
    "save_on_each_node": _SAVE,
    "restore_callback_states_from_checkpoint": _SAVE,
    "resume_from_checkpoint": changed(
        "resume",
        "resume_from_checkpoint",
        "a checkpoint-N folder (true: the newest in output_dir) continues with its weights, AdamW state, schedule "
        "and step; Trainer's data position does not carry over (accord goes on in its own global order)",
    ),
    "ignore_data_skip": dropped("accord resumes at the exact position in its global order"),
    "push_to_hub": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_token": _HUB,
    "hub_private_repo": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "hub_model_revision": _HUB,
    "log_completions_hub_repo": _HUB,
    "remove_unused_columns": dropped("accord reads only the columns its task needs"),
    "length_column_name": _LOADER,
    "dataloader_drop_last": _LOADER,
    "dataloader_num_workers": _LOADER,
    "dataloader_pin_memory": _LOADER,
    "dataloader_persistent_workers": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "dataloader_multiprocessing_context": _LOADER,
    "dataloader_in_order": _LOADER,
    # ---------------------------------------------------------------- older names (alignment-handbook, TRL < 1)
    "max_seq_length": mapped("data.max_length", how="max_length", note="older name of max_length"),
    "dataset_mixer": mapped("data.train", how="mixer", note="alignment-handbook: {dataset: fraction}"),
    "dataset_mixture": changed(
        "data.train",
        "handbook_mixture",
        "alignment-handbook: {datasets: [{id, weight}], test_split_size}; weight (the share of a dataset's rows "
        "kept, a seeded draw) becomes the source's fraction, test_split_size data.eval_fraction",
    ),
    "dataset_splits": mapped("data.train.split", how="splits", note="alignment-handbook: [train split, test split]"),
    "dataset_configs": mapped("data.train.config", how="configs", note="alignment-handbook: one per dataset"),
    "preprocessing_num_workers": mapped("data.prepare_workers"),
    "chat_template": refused("an inline chat template has no recipe key", "a tokenizer folder with it"),
    "text_column": mapped("data.train.fields", how="text_field"),
    "truncation_side": mapped("data.truncation", how="truncation"),
    "auto_insert_empty_system_msg": dropped("accord applies the tokenizer's chat template as it renders"),
    "torch_dtype": changed("engine.precision", "dtype", "older name of dtype"),
    "use_flash_attention_2": changed("model.attn_implementation", "flash_attention", "true becomes flash_attention_2"),
    # ---------------------------------------------------------------- DPO
    "beta": mapped("dpo.beta", how="beta"),
    "precompute_ref_log_probs": mapped("dpo.precompute_reference"),
    "precompute_ref_batch_size": _SPEED,
    "loss_weights": mapped("dpo.loss_weights"),
    "label_smoothing": mapped("dpo.label_smoothing"),
    "ld_alpha": refused("length-desensitised DPO is not supported", "leave unset"),
    "f_divergence_type": refused("f-divergence DPO is not supported", "reverse_kl"),
    "f_alpha_divergence_coef": refused("f-divergence DPO is not supported", "leave unset"),
    "use_weighting": refused("WPO weighting is not supported", "false"),
    "discopop_tau": refused("DiscoPOP is not supported", "loss_type: sigmoid"),
    "sync_ref_model": refused("TR-DPO's reference syncing is not supported", "false"),
    "ref_model_mixup_alpha": refused("TR-DPO's reference syncing is not supported", "leave unset"),
    "ref_model_sync_steps": refused("TR-DPO's reference syncing is not supported", "leave unset"),
    # ---------------------------------------------------------------- KTO
    "desirable_weight": mapped("kto.desirable_weight"),
    "undesirable_weight": mapped("kto.undesirable_weight"),
    # ---------------------------------------------------------------- reward
    "center_rewards_coefficient": refused("reward centring is not supported", "leave unset"),
    # ---------------------------------------------------------------- GRPO
    "reward_model_name_or_path": mapped("grpo.rewards", how="reward_model"),
    "reward_funcs": refused("TRL's named reward functions", "grpo.rewards (exact_match, regex, length, function)"),
    "reward_weights": mapped("grpo.rewards", how="reward_weights"),
    "num_generations": mapped("grpo.group_size"),
    "max_completion_length": mapped("grpo.max_new_tokens"),
    "temperature": mapped("grpo.temperature"),
    "top_p": mapped("grpo.top_p"),
    "epsilon": mapped("grpo.epsilon"),
    "num_iterations": mapped("grpo.num_iterations"),
    "num_generations_eval": _EVAL_ONLY,
    "log_completions": _LOG,
    "log_multimodal": _LOG,
    "num_completions_to_print": _LOG,
    "log_unique_prompts": _LOG,
    "cast_lm_head_to_fp32": refused("an fp32 lm_head under bf16 is not supported", "false"),
    "ds3_gather_for_generation": _SPEED,
    "generation_batch_size": refused("generation batches apart from the global batch", "leave unset"),
    "steps_per_generation": refused("generation batches apart from the global batch", "leave unset"),
    "use_transformers_continuous_batching": _SPEED,
    "transformers_continuous_batching_config": _SPEED,
    "use_transformers_paged": _SPEED,
    "cache_implementation": _SPEED,
    "max_tool_calling_iterations": refused("tool calling during rollouts is not supported", "leave unset"),
    "chat_template_kwargs": refused("chat template arguments have no recipe key", "leave unset"),
    "mask_truncated_completions": refused("masking truncated completions is not supported", "false"),
    "use_bias_correction_kl": refused("bias-corrected KL is not supported", "false"),
    "off_policy_mask_threshold": refused("off-policy masking is not supported", "leave unset"),
    "multi_objective_aggregation": refused("only a weighted sum of rewards is supported", "sum_then_normalize"),
    **_each(
        "top_k min_p repetition_penalty generation_kwargs",
        refused("sampling settings beyond temperature/top_p are not supported", "leave unset"),
    ),
    **_each(
        "delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg "
        "vespo_lambda_neg importance_sampling_level scale_rewards top_entropy_quantile entropy_coef "
        "use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target",
        refused("a GRPO loss variant accord does not run", "leave at TRL's default"),
    ),
    **_each(
        "use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex "
        "vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port "
        "vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size",
        _VLLM,
    ),
    **_each(
        "vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max "
        "vllm_importance_sampling_clip_min vllm_importance_sampling_cap",
        _VLLM,
    ),
}

# Keys whose value is read before the table (the task's own defaults keep them in RULES too).
ALIASES = {"evaluation_strategy": "eval_strategy", "max_seq_length": "max_length", "torch_dtype": "dtype"}

# An accelerate config's keys: what `accelerate launch --config_file` was given.
ACCELERATE_RULES: dict[str, Rule] = {
    "num_processes": changed("batch.global_batch_size", "devices", "the device count of the global batch"),
    "num_machines": changed("batch.global_batch_size", "nodes", "num_processes counts every machine already"),
    "mixed_precision": mapped("engine.precision", how="mixed_precision"),
    "distributed_type": mapped("engine.strategy", how="distributed_type"),
    "deepspeed_config": changed("engine.strategy", "accelerate_deepspeed", "zero_stage and offload devices"),
    "fsdp_config": changed("engine.strategy", "fsdp_config", "activation checkpointing is kept, the rest derived"),
    "use_cpu": changed("engine.device", "use_cpu", "true becomes engine.device=cpu"),
    "gpu_ids": dropped("accord train --devices 0,1 picks GPUs"),
    "parallelism_config": refused("accelerate's parallelism_config in an import", "accelerate launch -m accord train"),
    "downcast_bf16": refused("TPU downcasting is not supported", "no"),
    **_each(
        "compute_environment debug machine_rank main_process_ip main_process_port rdzv_backend same_network "
        "main_training_function enable_cpu_affinity mpirun_config command_file commands",
        _RUN,
    ),
    **_each(
        "tpu_name tpu_zone tpu_use_cluster tpu_use_sudo tpu_vm tpu_env",
        refused("TPUs are not supported", "GPUs or CPUs"),
    ),
    "megatron_lm_config": refused("Megatron-LM is not supported", "engine.tensor_parallel"),
    "fp8_config": refused("fp8 training is not supported", "mixed_precision: bf16"),
    "dynamo_config": dropped("accord's engine.compile compiles the model itself"),
}


def markdown_table() -> str:
    """The table above as markdown, for docs/coming-from-trl.md (regenerated, never hand-edited)."""
    lines = ["| TRL / Trainer key | decision | recipe key | why / how |", "|---|---|---|---|"]
    for key in sorted(RULES):
        rule = RULES[key]
        why = rule.note + (f"; use {rule.nearest}" if rule.nearest else "")
        lines.append(f"| `{key}` | {rule.decision} | {f'`{rule.target}`' if rule.target else ''} | {why} |")
    lines += ["", "| accelerate config key | decision | recipe key | why / how |", "|---|---|---|---|"]
    for key in sorted(ACCELERATE_RULES):
        rule = ACCELERATE_RULES[key]
        why = rule.note + (f"; use {rule.nearest}" if rule.nearest else "")
        lines.append(f"| `{key}` | {rule.decision} | {f'`{rule.target}`' if rule.target else ''} | {why} |")
    return "\n".join(lines)
