//! `kvroute inspect` as a user runs it: the real binary on golden payloads.

use std::path::PathBuf;

use serde_json::Value;

use crate::support::kvroute;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kvroute-core/tests/fixtures")
        .join(name)
}

fn inspect(args: &[&str]) -> (i32, Vec<Value>, String) {
    let out = kvroute()
        .arg("inspect")
        .args(args)
        .output()
        .expect("kvroute runs");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    (
        out.status.code().unwrap_or(-1),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inspect_prints_one_json_line_per_event_of_a_wide_pad_batch() {
    let path = fixture("sglang_0.5.23_wide_mm_pad.hex");
    let (code, lines, _) = inspect(&[
        "--hex",
        path.to_str().expect("utf-8 path"),
        "--block-size",
        "16",
        "--tokens",
    ]);
    assert_eq!(code, 0);
    assert_eq!(lines.len(), 1);
    let event = &lines[0];
    assert_eq!(event["kind"], "stored");
    assert_eq!(event["dp_rank"], 0);
    assert_eq!(event["tier"], "device");
    assert_eq!(
        event["block_hashes"][0].as_u64(),
        Some(-2104976472952425150i64 as u64)
    );
    assert_eq!(event["local_hashes"][3].as_u64(), Some(3407184178956116715));
    // The first wide pad id, folded into the image pad range.
    assert_eq!(
        event["token_ids"][16].as_u64(),
        Some(1_000_000 + (4347295146520627095u64 & ((1 << 30) - 1)))
    );
}

#[test]
fn inspect_reports_every_event_kind_and_omits_tokens_by_default() {
    let path = fixture("vllm_0.33.0_lookahead_cpu_removed_cleared.hex");
    let (code, lines, _) = inspect(&[
        "--hex",
        path.to_str().expect("utf-8 path"),
        "--block-size",
        "16",
    ]);
    assert_eq!(code, 0);
    let kinds: Vec<&str> = lines
        .iter()
        .map(|l| l["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(
        kinds,
        ["stored", "stored", "removed", "removed", "removed", "cleared"]
    );
    assert_eq!(lines[1]["tier"], "host");
    // Six lines (checked above), none with tokens.
    assert!(lines.iter().all(|l| l.get("token_ids").is_none()));
}

#[test]
fn inspect_reports_skipped_events_with_their_reason() {
    let path = fixture("vllm_0.33.0_text_chain.hex");
    let (code, lines, _) = inspect(&[
        "--hex",
        path.to_str().expect("utf-8 path"),
        "--block-size",
        "32",
    ]);
    assert_eq!(
        code, 0,
        "an envelope that decodes exits 0 even when events are skipped"
    );
    // The batch's two stored events, each reported with why it was skipped.
    let indices: Vec<&Value> = lines.iter().map(|l| &l["index"]).collect();
    assert_eq!(indices, [0, 1], "{lines:?}");
    for line in &lines {
        assert_eq!(line["reason"], "block_size_mismatch", "{line}");
        let error = line["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("event block_size 16, worker block size 32"),
            "{line}"
        );
    }
}

#[test]
fn inspect_fails_clearly_on_an_unreadable_envelope() {
    let dir = std::env::temp_dir().join(format!("kvroute-inspect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let raw = dir.join("int.raw");
    std::fs::write(&raw, [0x05]).expect("write");
    let (code, lines, stderr) = inspect(&["--raw", raw.to_str().expect("utf-8 path")]);
    assert_ne!(code, 0);
    assert!(lines.is_empty());
    assert!(stderr.contains("not a batch"), "{stderr}");

    let hex = dir.join("odd.hex");
    std::fs::write(&hex, "# comment\nabc\n").expect("write");
    let (code, _, stderr) = inspect(&["--hex", hex.to_str().expect("utf-8 path")]);
    assert_ne!(code, 0);
    assert!(stderr.contains("odd number"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

fn hand_built_seed(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds/decode_batch")
        .join(name)
}

/// Every per-block image key form shows as the item each block's local hash
/// covers: TensorRT-LLM's `mm_keys` and digest tokens, Dynamo's
/// `block_mm_infos`, vLLM's `extra_keys`; the same item hash whatever the form.
#[test]
fn inspect_shows_the_image_items_of_every_key_form() {
    let items = |path: PathBuf| -> Vec<(u64, u64)> {
        let (code, lines, err) = inspect(&["--hex", path.to_str().expect("utf-8 path")]);
        assert_eq!(code, 0, "{err}");
        lines
            .iter()
            .filter_map(|l| l["image_items"].as_array())
            .flatten()
            .map(|i| {
                (
                    i["block"].as_u64().expect("block"),
                    i["item"].as_u64().expect("item"),
                )
            })
            .collect()
    };
    // TensorRT-LLM: one image over the 3 blocks of the first store, a second
    // image (with a uuid) over the child store's 2 blocks.
    let trt = items(fixture("trtllm_multimodal_mm_keys.hex"));
    assert_eq!(trt.len(), 5, "{trt:?}");
    assert!(
        trt[..3].iter().all(|&(_, item)| item == 0x2a2688f3dfbb1087),
        "{trt:?}"
    );
    // The same digest-first image without mm_keys is still named, on every
    // block its positions reach in the event.
    let bare = items(hand_built_seed("trtllm_digest_without_mm_keys.hex"));
    assert_eq!(bare, [(0, 0xabababababababab), (1, 0xabababababababab)]);
    assert_eq!(
        items(hand_built_seed("dynamo_block_mm_infos.hex")),
        [(0, 0xabababababababab)]
    );
    let vllm = items(fixture("vllm_0.34.0_multimodal_text_chain.hex"));
    assert_eq!(vllm.len(), 3, "{vllm:?}");
}

/// A hybrid model's window and state groups show as group events with their
/// rule; an offloading placeholder as skipped on purpose; a REMOTE tier as external.
#[test]
fn inspect_shows_hybrid_groups_tiers_and_placeholders() {
    let path = fixture("vllm_0.34.0_offload_storage_remote.hex");
    let (code, lines, _) = inspect(&["--hex", path.to_str().expect("utf-8 path")]);
    assert_eq!(code, 0);
    let kinds: Vec<Option<&str>> = lines.iter().map(|l| l["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            Some("stored"),
            Some("stored"),
            Some("removed"),
            None,
            Some("group")
        ]
    );
    assert_eq!(
        (lines[0]["tier"].as_str(), lines[1]["tier"].as_str()),
        (Some("host"), Some("external"))
    );
    assert_eq!(lines[3]["reason"], "placeholder");
    assert_eq!(
        (lines[4]["rule"].as_str(), lines[4]["group"].as_u64()),
        (Some("state"), Some(2))
    );
    let path = fixture("vllm_0.34.0_hybrid_sliding_window.hex");
    let (_, lines, _) = inspect(&["--hex", path.to_str().expect("utf-8 path")]);
    assert_eq!(lines[1]["kind"], "group");
    assert_eq!(lines[1]["rule"]["window_blocks"], 2);
    assert_eq!(
        (lines[2]["kind"].as_str(), lines[2]["stored"].as_bool()),
        (Some("group"), Some(false))
    );
}
