//! Rendering prompts with a real tokenizer (GPT-2's vocabulary in Qwen2's
//! pipeline, `tests/data`), against plain `tokenizers` as the baseline:
//!
//! * `completion_512/*`: a 512-word completion prompt. `hf_encode` and
//!   `hf_encode_fast` are `tokenizers` alone (the path before the segment
//!   cache); `render_miss` renders a prompt never seen before (unique per
//!   iteration), `render_hit` one rendered before, `render_shared_prefix` a
//!   new prompt whose first 400 words were rendered before.
//! * `chat/*`: a ~400-word system prompt and a unique ~20-word question
//!   through Qwen2's template. `hf_encode` renders the template and encodes
//!   the whole text with `tokenizers`; `render` is the renderer (the system
//!   prompt's pieces come from the cache, the question is encoded).
//!
//! `cargo bench -p kvroute-prompt --features hf --bench render` (pin with
//! `taskset -c 0` on a noisy machine).

#[path = "../tests/support/fixtures.rs"]
mod fixtures;
mod support {
    pub mod cases;
}
use support::cases;

criterion::criterion_main!(cases::benches);
