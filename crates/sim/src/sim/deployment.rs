//! The figures `rankgate mock-engine` starts with unless told otherwise: one common real
//! deployment, a 7-8B model (Llama-3.1-8B) in bf16 on one 80 GB GPU (an H100 SXM) under vLLM's
//! defaults, one rank per GPU. With them a rank is as big and as fast as a real one, so what a
//! router does with a conversation on an idle fleet is what it would do in production: a
//! 1k-token chat is a quarter of a percent of a rank, not a quarter of it.
//!
//! [`super::SimConfig::default`] keeps its small engine (4,096 tokens, 200 tokens/s, 20,000
//! prompt tokens/s): the tests, the scenarios and `rankgate demo` count on load showing within a
//! few requests, and get those figures by leaving them unset.
//!
//! [`help`] is what `rankgate mock-engine --help` says of them. How each figure is reached (the
//! arithmetic is the constants below):
//!
//! - KV capacity. vLLM gives the KV cache what is left of `gpu_memory_utilization` (0.9) of the
//!   GPU's memory once the weights and the runtime are in: 0.9 x 79.2 GiB (what CUDA reports
//!   for an 80 GB card) = 71.3 GiB, less 14.96 GiB of weights (8.03 G parameters x 2 bytes),
//!   less about 2.5 GiB of runtime (the profiling run's activations at 8,192 batched tokens,
//!   CUDA graphs, the CUDA context) = 53.8 GiB. Llama-3.1-8B holds 2 (K and V) x 32 layers x 8
//!   KV heads x 128 dims x 2 bytes = 128 KiB of KV a token, so 53.8 GiB is 440,912 tokens:
//!   27,557 blocks of 16 (vLLM's GPU block size). SGLang with `--mem-fraction-static 0.9` lands
//!   within a few percent of it.
//! - Decode. At a small batch a decode step reads every weight once: 16.06 GB at the H100 SXM's
//!   3.35 TB/s is 4.8 ms, and decode kernels reach about 77% of that bandwidth, so 6.25 ms a
//!   token: 160 tokens/s for a request alone on its rank. Each other running request
//!   slows it 2% ([`super::SimConfig::batch_slowdown`], not a flag): 10 ms a token with 32
//!   running, as the growing KV reads make a memory-bound step slower.
//! - Prefill. A prompt token costs 2 x 8.03 G = 16 GFLOP; the H100 SXM's 989 dense bf16 TFLOPS
//!   at about half of peak, what prefill reaches, is 30,800 tokens/s, taken as 30,000 (a 1k-token
//!   prompt prefills in 34 ms).
//! - Running requests. vLLM's OpenAI server defaults `--max-num-seqs` by the GPU: 1,024 on one
//!   with at least 70 GiB that is not an A100 (the H100 here, an H200, an MI300X), 256 on the
//!   rest. The sim takes the H100's 1,024 for every engine, the tests' small one included,
//!   whose 4,096 tokens fill long before that many requests run.

/// Bytes in a MiB.
const MIB: u64 = 1 << 20;

/// An 80 GB GPU's memory as CUDA reports it (about 79.2 GiB), in MiB.
pub const GPU_MEMORY_MIB: u64 = 81_100;

/// vLLM's default `--gpu-memory-utilization`, in tenths.
pub const GPU_MEMORY_UTILIZATION_TENTHS: u64 = 9;

/// Llama-3.1-8B's weights in bf16: 8,030,261,248 parameters x 2 bytes, in MiB.
pub const WEIGHTS_MIB: u64 = 8_030_261_248 * 2 / MIB;

/// What the runtime holds besides weights and KV (activations of vLLM's profiling run, CUDA
/// graphs, the CUDA context), in MiB: an estimate, about 2.5 GiB.
pub const RUNTIME_MIB: u64 = 2_560;

/// KV bytes a token of Llama-3.1-8B takes: K and V, 32 layers, 8 KV heads (GQA) of 128 dims,
/// 2 bytes each (bf16).
pub const KV_BYTES_PER_TOKEN: u64 = 2 * 32 * 8 * 128 * 2;

/// vLLM's KV block size on GPUs, in tokens.
pub const BLOCK_TOKENS: u64 = super::prefix::BLOCK_TOKENS;

/// What is left for KV, in MiB.
pub const KV_MIB: u64 =
    GPU_MEMORY_MIB * GPU_MEMORY_UTILIZATION_TENTHS / 10 - WEIGHTS_MIB - RUNTIME_MIB;

/// KV capacity of one rank in tokens: whole blocks of what is left for KV (440,912).
pub const CAPACITY_TOKENS: u64 = KV_MIB * MIB / KV_BYTES_PER_TOKEN / BLOCK_TOKENS * BLOCK_TOKENS;

/// Tokens per second one request decodes at alone on its rank (6.25 ms a token).
pub const DECODE_TOKENS_PER_SEC: f64 = 160.0;

/// Prompt tokens per second of prefill.
pub const PREFILL_TOKENS_PER_SEC: f64 = 30_000.0;

/// vLLM's `--max-num-seqs` for the OpenAI server on an 80 GB H100: requests running per rank.
pub const MAX_NUM_SEQS: u32 = 1024;

/// What `mock-engine --help` says after the flags: the deployment its defaults are, and where
/// the built-in tokenizer's files are (from the constants, so it cannot drift from them).
pub fn help() -> String {
    let d = super::SimConfig::default();
    format!(
        "Defaults: one rank is a real one, Llama-3.1-8B (bf16) on one 80 GB GPU (H100 SXM) under \
         vLLM (--gpu-memory-utilization 0.9, blocks of {block} tokens): --capacity-tokens \
         {capacity}, --decode-rate {decode}, --prefill-rate {prefill}, so a 1k-token chat is \
         {share:.1}% of a rank. Smaller figures make load show within a few requests (the \
         tests' engine: --capacity-tokens {} --decode-rate {} --prefill-rate {}).\n\n\
         Tokenizer: with --kv-events-config the ranks name their KV blocks with the built-in \
         tiny model's tokenizer, shipped in {dir}/ (tokenizer.json, tokenizer_config.json, \
         chat_template.jinja). A router matches those blocks with:\n  \
         [[models]]\n  \
         name = \"tiny-llama\"\n  \
         tokenizer = \"{dir}\"   # relative to where rankgate runs",
        d.capacity_tokens,
        d.decode_tokens_per_sec,
        d.prefill_tokens_per_sec,
        block = BLOCK_TOKENS,
        capacity = CAPACITY_TOKENS,
        decode = DECODE_TOKENS_PER_SEC,
        prefill = PREFILL_TOKENS_PER_SEC,
        share = 100.0 * 1024.0 / CAPACITY_TOKENS as f64,
        dir = super::model::SHIPPED_DIR,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capacity_is_whole_blocks_of_what_the_gpu_leaves_for_kv() {
        assert_eq!(
            KV_BYTES_PER_TOKEN,
            128 * 1024,
            "Llama-3.1-8B: 128 KiB a token"
        );
        assert_eq!(CAPACITY_TOKENS % BLOCK_TOKENS, 0);
        let used = CAPACITY_TOKENS * KV_BYTES_PER_TOKEN + (WEIGHTS_MIB + RUNTIME_MIB) * MIB;
        let budget = GPU_MEMORY_MIB * MIB * GPU_MEMORY_UTILIZATION_TENTHS / 10;
        assert!(used <= budget && budget - used < BLOCK_TOKENS * KV_BYTES_PER_TOKEN);
        // A 1k-token chat is a quarter of a percent of a rank, far inside any affinity margin.
        assert!((1024.0 / CAPACITY_TOKENS as f64) < 0.003);
    }
}
