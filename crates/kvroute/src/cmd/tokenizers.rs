//! `kvroute serve`'s tokenizer discovery flags: where the router looks for
//! each model's tokenizer when `--tokenizer` and `--model` do not name it
//! (`kvroute_server::tokenizers`).

use clap::Args;
use kvroute_prompt::ImageTokenRule;
use kvroute_server::tokenizers::hub::HubConfig;
use kvroute_server::tokenizers::{DiscoveryConfig, SourceKind};

/// The tokenizer discovery flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct TokenizerArgs {
    /// Where each model's tokenizer and chat template are looked for, in
    /// this order, when --tokenizer and --model do not name it: `root` (the
    /// folder the engine's /v1/models names, if readable here), `cache` (the
    /// Hugging Face cache: HF_HUB_CACHE, HF_HOME), `hub` (a download into
    /// that cache; HF_TOKEN, HF_ENDPOINT; never with HF_HUB_OFFLINE=1),
    /// `engine` (the engine's own POST /tokenize, a round trip per request);
    /// `none`: no discovery. A model none of them serves is routed on load
    /// alone, and the router says so at start
    #[arg(long, value_delimiter = ',', default_value = "root,cache,hub,engine", value_parser = parse_source, env = "KVROUTE_TOKENIZER_SOURCES")]
    tokenizer_sources: Vec<Option<SourceKind>>,
}

/// A source, or `none`.
fn parse_source(value: &str) -> Result<Option<SourceKind>, String> {
    match value.trim() {
        "none" => Ok(None),
        other => other.parse().map(Some),
    }
}

impl TokenizerArgs {
    /// The discovery settings, with the hub's from the environment and
    /// found tokenizers rendering images as `image_rule` lays them out.
    pub fn discovery(&self, image_rule: ImageTokenRule) -> DiscoveryConfig {
        let wanted: Vec<SourceKind> = self.tokenizer_sources.iter().flatten().copied().collect();
        DiscoveryConfig {
            sources: SourceKind::ALL
                .into_iter()
                .filter(|k| wanted.contains(k))
                .collect(),
            hub: HubConfig::from_env(|name| std::env::var(name).ok()),
            image_rule,
        }
    }
}
