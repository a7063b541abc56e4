//! A routing request as routing keys it: its local block hashes, as an
//! engine of a given block size and flavour publishes them for the same
//! prompt (what the index is matched with), and the symbols of its text
//! (what SGLang's `cache_aware` tree keys an untokenized prompt by). The
//! router and the simulator both hash requests here.

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{namespace_seed, LocalBlockHash};
use kvroute_core::multimodal::prompt_local_hashes;

use crate::body::{RoutingRequest, TextPrompt};

impl RoutingRequest {
    /// The request's local block hashes at `block_size`, as a worker of
    /// `flavor` publishes them (the flavour matters only for prompts with
    /// images: SGLang's folded wide pads, or vLLM's item hashes on
    /// overlapping blocks), in its LoRA adapter's and salt's namespace.
    /// Empty without tokens.
    pub fn local_hashes(&self, block_size: u32, flavor: WorkerFlavor) -> Vec<LocalBlockHash> {
        let Some(tokens) = &self.tokens else {
            return Vec::new();
        };
        let seed = namespace_seed(self.lora_name.as_deref(), self.cache_salt.as_deref());
        prompt_local_hashes(tokens, &self.images, flavor, block_size as usize, seed)
    }

    /// The characters of its text prompt as the body gives it (a chat's
    /// messages as their JSON text), for a prompt without tokens.
    pub fn text_symbols(&self) -> Vec<u32> {
        let chars = |s: &str| s.chars().map(u32::from).collect();
        match &self.text {
            Some(TextPrompt::Completion(serde_json::Value::String(s))) => chars(s),
            Some(TextPrompt::Completion(v) | TextPrompt::Chat(v)) => chars(&v.to_string()),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::{local_block_hashes, HASH_SEED};
    use kvroute_core::multimodal::{ImageIdentity, ImageSpan};

    #[test]
    fn a_request_hashes_its_tokens_and_images_as_each_flavour_publishes_them() {
        let plain = RoutingRequest {
            tokens: Some((0..16).collect()),
            ..RoutingRequest::default()
        };
        assert_eq!(
            plain.local_hashes(4, WorkerFlavor::Vllm),
            local_block_hashes(&(0..16).collect::<Vec<_>>(), 4, HASH_SEED, 0)
        );
        assert!(RoutingRequest::default()
            .local_hashes(4, WorkerFlavor::Vllm)
            .is_empty());
        let mut tokens: Vec<u32> = (0..4).collect();
        tokens.extend([151_655; 8]);
        let req = RoutingRequest {
            tokens: Some(tokens.clone()),
            images: vec![ImageSpan {
                start: 4,
                len: 8,
                identity: ImageIdentity::from_hash(42),
            }],
            ..RoutingRequest::default()
        };
        let vllm = req.local_hashes(4, WorkerFlavor::Vllm);
        let sglang = req.local_hashes(4, WorkerFlavor::Sglang);
        assert_eq!(vllm.len(), 3);
        assert_eq!(vllm[0], sglang[0], "the text block is the same");
        assert_ne!(vllm[1..], sglang[1..], "the image blocks differ");
        assert_ne!(vllm[1], local_block_hashes(&tokens, 4, HASH_SEED, 0)[1]);
        let adapter = RoutingRequest {
            lora_name: Some("a".into()),
            ..plain.clone()
        };
        assert_ne!(
            adapter.local_hashes(4, WorkerFlavor::Vllm),
            plain.local_hashes(4, WorkerFlavor::Vllm),
            "an adapter's blocks are its own"
        );
    }

    #[test]
    fn a_text_prompt_is_keyed_by_its_characters() {
        let text = RoutingRequest {
            text: Some(TextPrompt::Completion(serde_json::json!("hé"))),
            ..RoutingRequest::default()
        };
        assert_eq!(text.text_symbols(), [u32::from('h'), u32::from('é')]);
        let chat = RoutingRequest {
            text: Some(TextPrompt::Chat(serde_json::json!([{"content": "x"}]))),
            ..RoutingRequest::default()
        };
        assert_eq!(chat.text_symbols().len(), r#"[{"content":"x"}]"#.len());
        assert!(RoutingRequest::default().text_symbols().is_empty());
    }
}
