//! `kvroute inspect`: decode one payload captured from an engine's event stream.
//!
//! Prints one JSON object per event, in batch order, with both hash spaces, so
//! an operator can see exactly what kvroute makes of an engine's bytes: which
//! events decode, which are skipped and why, the image items each block's
//! local hash covers (whichever per-block key form named them), and a hybrid
//! model's window and state groups.

use std::fs;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use kvroute_core::event::{GroupRule, KvEvent};
use kvroute_core::wire::{decode_batch, DecodedBatch, DecoderConfig};
use serde_json::{json, Map, Value};

/// Arguments of `kvroute inspect`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["hex", "raw"])))]
pub struct InspectArgs {
    /// A file whose first line may be a `#` comment and whose next line is the payload as hex (`-` for stdin).
    #[arg(long, value_name = "FILE")]
    hex: Option<PathBuf>,
    /// A file holding the raw msgpack payload (`-` for stdin).
    #[arg(long, value_name = "FILE")]
    raw: Option<PathBuf>,
    /// The worker's block size; stored events of another size are reported as skipped.
    /// Without it each event's own block size is trusted.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    block_size: Option<u32>,
    /// The rank to report when the batch carries none.
    #[arg(long, value_name = "R", default_value_t = 0)]
    dp_rank: u32,
    /// Also print each stored event's folded token ids.
    #[arg(long)]
    tokens: bool,
}

/// Runs the subcommand: exit 0 when the envelope decoded (even if events were skipped).
pub fn run(args: &InspectArgs) -> Result<ExitCode> {
    let payload = match (&args.hex, &args.raw) {
        (Some(path), _) => parse_hex_file(&read_input(path)?)
            .with_context(|| format!("reading hex from {}", path.display()))?,
        (None, Some(path)) => read_input(path)?,
        (None, None) => bail!("give --hex FILE or --raw FILE"),
    };
    // Kept tokens also keep each block's image items, which are always shown.
    let config = DecoderConfig {
        block_size: args.block_size,
        registered_rank: args.dp_rank,
        keep_tokens: true,
        ..DecoderConfig::default()
    };
    let batch =
        decode_batch(&payload, &config).context("the payload is not a readable KV-event batch")?;
    let mut out = io::stdout().lock();
    for line in render(&batch, args.tokens) {
        if let Err(e) = writeln!(out, "{line}") {
            // `kvroute inspect … | head` closes the pipe early: that is not a failure.
            if e.kind() == io::ErrorKind::BrokenPipe {
                return Ok(ExitCode::SUCCESS);
            }
            return Err(e).context("writing to stdout");
        }
    }
    if batch.lost_events > 0 {
        eprintln!(
            "kvroute: {} event(s) after the cut could not be located",
            batch.lost_events
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn read_input(path: &PathBuf) -> Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        io::stdin()
            .read_to_end(&mut bytes)
            .context("reading stdin")?;
        return Ok(bytes);
    }
    fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// Extracts the payload from a hex file: `#` comment lines and whitespace are ignored.
fn parse_hex_file(bytes: &[u8]) -> Result<Vec<u8>> {
    let text = std::str::from_utf8(bytes).context("hex file is not UTF-8 text")?;
    let digits: Vec<u8> = text
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .flat_map(|line| line.bytes())
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    if digits.is_empty() {
        bail!("no hex payload found (expected a line of hex digits after any # comment)");
    }
    if !digits.len().is_multiple_of(2) {
        bail!("hex payload has an odd number of digits ({})", digits.len());
    }
    digits
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| {
            let text = std::str::from_utf8(pair).unwrap_or("??");
            u8::from_str_radix(text, 16)
                .with_context(|| format!("invalid hex {text:?} at digit {}", i * 2))
        })
        .collect()
}

/// One JSON object per event of the batch.
pub fn render(batch: &DecodedBatch, with_tokens: bool) -> Vec<Value> {
    batch
        .events
        .iter()
        .map(|event| {
            let mut obj = Map::new();
            obj.insert("index".into(), json!(event.index));
            match &event.outcome {
                Ok(decoded) => {
                    obj.insert("kind".into(), json!(decoded.kind()));
                    obj.insert("dp_rank".into(), json!(batch.dp_rank));
                    match decoded {
                        KvEvent::Stored(s) => {
                            obj.insert("parent_hash".into(), json!(s.parent.map(|p| p.0)));
                            obj.insert(
                                "block_hashes".into(),
                                json!(s.blocks.iter().map(|b| b.external.0).collect::<Vec<_>>()),
                            );
                            obj.insert(
                                "local_hashes".into(),
                                json!(s.blocks.iter().map(|b| b.local.0).collect::<Vec<_>>()),
                            );
                            obj.insert("tier".into(), json!(s.tier.as_str()));
                            obj.insert("lora_name".into(), json!(s.lora_name));
                            obj.insert("cache_salt".into(), json!(s.cache_salt));
                            if s.lookahead > 0 {
                                obj.insert("lookahead".into(), json!(s.lookahead));
                            }
                            if s.dropped_blocks > 0 {
                                obj.insert("dropped_blocks".into(), json!(s.dropped_blocks));
                            }
                            if with_tokens {
                                obj.insert("token_ids".into(), json!(s.token_ids));
                            }
                            if let Some(items) = s.image_items.as_ref().filter(|i| !i.is_empty()) {
                                let items: Vec<Value> = items
                                    .iter()
                                    .map(|&(block, item)| json!({"block": block, "item": item}))
                                    .collect();
                                obj.insert("image_items".into(), json!(items));
                            }
                        }
                        KvEvent::Removed(r) => {
                            obj.insert(
                                "block_hashes".into(),
                                json!(r.blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                            );
                            obj.insert("tier".into(), json!(r.tier.as_str()));
                        }
                        KvEvent::Cleared => {}
                        KvEvent::Group(g) => {
                            obj.insert("group".into(), json!(g.group));
                            obj.insert("rule".into(), rule_json(g.rule));
                            obj.insert("stored".into(), json!(g.stored));
                            obj.insert(
                                "block_hashes".into(),
                                json!(g.blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                            );
                            obj.insert("tier".into(), json!(g.tier.as_str()));
                        }
                    }
                }
                Err(skipped) => {
                    obj.insert("kind".into(), Value::Null);
                    obj.insert("dp_rank".into(), json!(batch.dp_rank));
                    obj.insert("error".into(), json!(skipped.to_string()));
                    obj.insert("reason".into(), json!(skipped.reason.as_str()));
                }
            }
            Value::Object(obj)
        })
        .collect()
}

/// A hybrid group's rule as JSON.
fn rule_json(rule: GroupRule) -> Value {
    match rule {
        GroupRule::Window { blocks, stride } => {
            json!({"window_blocks": blocks, "stride": stride})
        }
        GroupRule::State => json!("state"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_files_may_start_with_a_comment() {
        assert_eq!(
            parse_hex_file(b"# a sample\n93cb00\n").expect("valid"),
            vec![0x93, 0xcb, 0x00]
        );
        assert_eq!(parse_hex_file(b"0a ff\n").expect("valid"), vec![0x0a, 0xff]);
    }

    #[test]
    fn bad_hex_files_get_a_clear_error() {
        assert!(parse_hex_file(b"# only a comment\n").is_err());
        assert!(parse_hex_file(b"abc")
            .expect_err("odd")
            .to_string()
            .contains("odd"));
        assert!(parse_hex_file(b"zz")
            .expect_err("not hex")
            .to_string()
            .contains("invalid hex"));
    }
}
