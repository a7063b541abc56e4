//! `serve`'s flags for moving the cache instead of the work: a request
//! whose prefix's holder is busy runs on a cooler rank that receives the
//! prefix from it, and a prefix hot for long is copied to a second rank
//! ahead of demand (docs/serving.md, "Moving the cache").

use kvroute_core::scheduler::{FetchConfig, ReplicaConfig};

/// When a request fetches its prefix from a busy holder (vLLM `both`
/// workers; off unless `--fetch-us-per-block` is given).
#[derive(clap::Args, Debug, Clone)]
pub struct FetchArgs {
    /// Move a busy holder's prefix to a cooler rank instead of waiting or
    /// recomputing, pricing each block moved at this many microseconds
    /// (the engines' measured transfer; the mock engines' is 20). Off when
    /// unset (docs/serving.md)
    #[arg(long, value_name = "US", value_parser = parse_non_negative, env = "KVROUTE_FETCH_US_PER_BLOCK")]
    fetch_us_per_block: Option<f64>,
    /// How much dearer the policy's choice must be than the fetch for the
    /// prefix to move (1: any cheaper fetch).
    #[arg(long, value_name = "M", default_value_t = FetchConfig::default().margin, value_parser = parse_margin, env = "KVROUTE_FETCH_MARGIN")]
    fetch_margin: f64,
    /// Copy a prefix whose holder has been saturated (a fetch off it would
    /// be cheaper than running there) for this many milliseconds to a
    /// second rank, ahead of demand, so later requests split between the
    /// two (vLLM `both` workers). Off when unset (docs/serving.md)
    #[arg(long, value_name = "MS", env = "KVROUTE_REPLICATE_HOT_MS")]
    replicate_hot_ms: Option<u64>,
    /// Copied blocks a rank may hold at once (released as its cache
    /// evicts them): what copies may take from its own prefixes.
    #[arg(long, value_name = "BLOCKS", default_value_t = ReplicaConfig::default().budget_blocks, env = "KVROUTE_REPLICA_BUDGET_BLOCKS")]
    replica_budget_blocks: u64,
}

impl FetchArgs {
    /// The placer's fetch rule, `None` when off.
    pub fn config(&self) -> Option<FetchConfig> {
        self.fetch_us_per_block.map(|us| FetchConfig {
            transfer_us_per_block: us,
            margin: self.fetch_margin,
            ..FetchConfig::default()
        })
    }

    /// The placer's copies ahead of demand, `None` when off.
    pub fn replicate(&self) -> Option<ReplicaConfig> {
        self.replicate_hot_ms.map(|hot_for_ms| ReplicaConfig {
            hot_for_ms,
            budget_blocks: self.replica_budget_blocks,
        })
    }
}

fn parse_non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number ≥ 0")),
    }
}

fn parse_margin(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 1.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number ≥ 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        fetch: FetchArgs,
    }

    #[test]
    fn the_fetch_is_off_unless_priced_and_its_margin_is_at_least_one() {
        let off = Cli::try_parse_from(["x"]).expect("parses");
        assert_eq!(off.fetch.config(), None);
        let on = Cli::try_parse_from(["x", "--fetch-us-per-block", "20", "--fetch-margin", "1.6"])
            .expect("parses");
        let c = on.fetch.config().expect("on");
        assert_eq!((c.transfer_us_per_block, c.margin), (20.0, 1.6));
        assert_eq!(c.min_blocks, FetchConfig::default().min_blocks);
        assert_eq!(off.fetch.replicate(), None, "copies are off by default");
        let copies = [
            "x",
            "--replicate-hot-ms",
            "0",
            "--replica-budget-blocks",
            "64",
        ];
        let copies = Cli::try_parse_from(copies).expect("parses");
        let r = copies.fetch.replicate().expect("on");
        assert_eq!((r.hot_for_ms, r.budget_blocks), (0, 64));
        for bad in [["--fetch-margin", "0.5"], ["--fetch-us-per-block", "-1"]] {
            assert!(
                Cli::try_parse_from(["x", bad[0], bad[1]]).is_err(),
                "{bad:?}"
            );
        }
    }
}
