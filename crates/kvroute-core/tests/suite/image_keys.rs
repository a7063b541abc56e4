//! Per-block image keys: every form an engine writes, for every flavour's
//! token layout, gives the block hashes the request side computes for the
//! same image, and never those of another image.

use super::common::mp;
use kvroute_core::event::{KvEvent, WorkerFlavor};
use kvroute_core::hash::{sequence_hashes, LocalBlockHash, HASH_SEED};
use kvroute_core::multimodal::{prompt_local_hashes, sglang_padding, ImageIdentity, ImageSpan};
use kvroute_core::wire::{decode_batch, DecodedBatch, DecoderConfig, SkipReason, StreamDecoder};

/// Writes msgpack values.
type Writer<'a> = &'a dyn Fn(&mut Vec<u8>);

const BS: usize = 8;
/// The image placeholder id the neutral prompt (and vLLM) puts in image positions.
const PLACEHOLDER: u64 = 151_655;
/// TensorRT-LLM's `mm_token_id_offset` in these events (a vocabulary size).
const TRT_OFFSET: u64 = 151_936;
/// The image's span: positions 10..30 of a 32-token prompt (blocks 1..4 of 8).
const START: usize = 10;
const LEN: usize = 20;

/// How an event names the image on each block it overlaps.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    /// No per-block key.
    Bare,
    /// vLLM `extra_keys`: `[[identifier, item start − block start]]`.
    VllmPairs,
    /// Older vLLM `extra_keys`: the bare 64-hex identifier.
    VllmHex,
    /// SGLang's `extra_keys`, a list aligned with `block_hashes` of string tuples.
    SglangExtraKeys,
    /// Dynamo's `block_mm_infos`.
    DynamoMmInfos,
    /// TensorRT-LLM's `mm_keys`.
    TrtllmMmKeys,
}

const FORMS: [Form; 6] = [
    Form::Bare,
    Form::VllmPairs,
    Form::VllmHex,
    Form::SglangExtraKeys,
    Form::DynamoMmInfos,
    Form::TrtllmMmKeys,
];

fn text(i: usize) -> u64 {
    1000 + i as u64 * 7
}

/// The neutral prompt: text, then the placeholder over the image's span.
fn neutral_tokens() -> Vec<u32> {
    (0..32)
        .map(|i| {
            if (START..START + LEN).contains(&i) {
                PLACEHOLDER as u32
            } else {
                text(i) as u32
            }
        })
        .collect()
}

fn image(identity: &ImageIdentity) -> ImageSpan {
    ImageSpan {
        start: START,
        len: LEN,
        identity: identity.clone(),
    }
}

/// The request side's local hashes for a worker of `flavor`.
fn request_hashes(flavor: WorkerFlavor, identity: &ImageIdentity) -> Vec<LocalBlockHash> {
    prompt_local_hashes(&neutral_tokens(), &[image(identity)], flavor, BS, HASH_SEED)
}

/// One token as an engine of `flavor` writes it at prompt position `i`.
enum Token {
    Id(u64),
    Digest(String),
}

fn engine_tokens(flavor: WorkerFlavor, identity: &ImageIdentity) -> Vec<Token> {
    let pads: Vec<u64> = sglang_padding(identity.hash, LEN).collect();
    (0..32)
        .map(|i| {
            if !(START..START + LEN).contains(&i) {
                return Token::Id(text(i));
            }
            let k = i - START;
            match flavor {
                WorkerFlavor::Vllm => Token::Id(PLACEHOLDER),
                WorkerFlavor::Sglang => Token::Id(pads[k]),
                WorkerFlavor::Trtllm if k == 0 => Token::Digest(identity.identifier.clone()),
                WorkerFlavor::Trtllm => Token::Id(TRT_OFFSET + k as u64),
            }
        })
        .collect()
}

/// Item start − block start for block `b`, when the image overlaps it.
fn overlap(b: usize) -> Option<i64> {
    let (lo, hi) = (b * BS, (b + 1) * BS);
    (START < hi && START + LEN > lo).then_some(START as i64 - lo as i64)
}

/// Writes one per-block list: `entry(b, offset)` for overlapping blocks, nil for the others.
fn per_block(out: &mut Vec<u8>, entry: &dyn Fn(&mut Vec<u8>, i64)) {
    mp::array(out, 4);
    for b in 0..4 {
        match overlap(b) {
            Some(offset) => entry(out, offset),
            None => mp::nil(out),
        }
    }
}

fn write_keys(out: &mut Vec<u8>, form: Form, identity: &ImageIdentity) -> bool {
    let id = identity.identifier.as_str();
    match form {
        Form::Bare => return false,
        Form::VllmPairs => {
            mp::str(out, "extra_keys");
            per_block(out, &|o, offset| {
                mp::array(o, 1);
                mp::array(o, 2);
                mp::str(o, id);
                mp::int(o, offset);
            });
        }
        Form::VllmHex | Form::SglangExtraKeys => {
            mp::str(out, "extra_keys");
            per_block(out, &|o, _| {
                mp::array(o, 1);
                mp::str(o, id);
            });
        }
        Form::DynamoMmInfos => {
            mp::str(out, "block_mm_infos");
            per_block(out, &|o, offset| {
                mp::map(o, 1);
                mp::str(o, "mm_objects");
                mp::array(o, 1);
                mp::map(o, 2);
                mp::str(o, "mm_hash");
                mp::uint(o, identity.hash);
                mp::str(o, "offsets");
                mp::array(o, 1);
                mp::array(o, 2);
                mp::uint(o, offset.max(0) as u64);
                mp::uint(o, (offset + LEN as i64).min(BS as i64) as u64);
            });
        }
        Form::TrtllmMmKeys => {
            mp::str(out, "mm_keys");
            per_block(out, &|o, offset| {
                mp::array(o, 1);
                mp::map(o, 3);
                mp::str(o, "type");
                mp::str(o, "mm_key");
                mp::str(o, "hash");
                mp::str(o, id);
                mp::str(o, "start_offset");
                mp::uint(o, (-offset).max(0) as u64);
            });
        }
    }
    true
}

/// A batch `[ts, events, nil]`.
fn batch_of(events: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, 3);
    mp::f64(&mut out, 1.0);
    mp::array(&mut out, events.len());
    for e in events {
        out.extend_from_slice(e);
    }
    mp::nil(&mut out);
    out
}

/// A batch with one `BlockStored` of the 4 blocks, as an engine of `flavor`
/// writes the image, named per block in `form`.
fn event_batch(flavor: WorkerFlavor, form: Form, identity: &ImageIdentity) -> Vec<u8> {
    batch_of(&[&event_bytes(flavor, form, identity)])
}

/// The `BlockStored` of [`event_batch`].
fn event_bytes(flavor: WorkerFlavor, form: Form, identity: &ImageIdentity) -> Vec<u8> {
    let mut keys = Vec::new();
    let with_keys = write_keys(&mut keys, form, identity);
    let mut out = Vec::new();
    mp::map(&mut out, 5 + usize::from(with_keys));
    mp::str(&mut out, "type");
    mp::str(&mut out, "BlockStored");
    mp::str(&mut out, "block_hashes");
    mp::uints(&mut out, &[11, 12, 13, 14]);
    mp::str(&mut out, "parent_block_hash");
    mp::nil(&mut out);
    mp::str(&mut out, "token_ids");
    let tokens = engine_tokens(flavor, identity);
    mp::array(&mut out, tokens.len());
    for t in &tokens {
        match t {
            Token::Id(id) => mp::uint(&mut out, *id),
            Token::Digest(d) => mp::str(&mut out, d),
        }
    }
    mp::str(&mut out, "block_size");
    mp::uint(&mut out, BS as u64);
    out.extend_from_slice(&keys);
    out
}

fn config() -> DecoderConfig {
    DecoderConfig {
        block_size: Some(BS as u32),
        ..Default::default()
    }
}

fn event_hashes(batch: &DecodedBatch) -> Vec<LocalBlockHash> {
    match &batch.events[0].outcome {
        Ok(KvEvent::Stored(s)) => s.blocks.iter().map(|b| b.local).collect(),
        other => panic!("not a store: {other:?}"),
    }
}

/// Whether `form` names the image on a `flavor` worker's blocks the way its
/// request side expects. SGLang's wide pads carry the identity in the tokens,
/// so every form agrees there (keys on such blocks are not added again); the
/// other layouts need a key (TensorRT-LLM's own digest token is one).
fn agrees(flavor: WorkerFlavor, form: Form) -> bool {
    match flavor {
        WorkerFlavor::Sglang | WorkerFlavor::Trtllm => true,
        WorkerFlavor::Vllm => form != Form::Bare,
    }
}

#[test]
fn every_form_and_flavour_hashes_an_image_like_the_request_side() {
    let a = ImageIdentity::from_url("data:image/png;base64,aGVsbG8=").expect("image a");
    let b = ImageIdentity::from_url("data:image/png;base64,d29ybGQ=").expect("image b");
    let mut rows = 0;
    for flavor in WorkerFlavor::ALL {
        let request_a = request_hashes(flavor, &a);
        let request_b = request_hashes(flavor, &b);
        assert_ne!(
            request_a[0..],
            request_b[0..],
            "{flavor}: images differ on the request side"
        );
        for form in FORMS {
            let got_a =
                event_hashes(&decode_batch(&event_batch(flavor, form, &a), &config()).expect("a"));
            let got_b =
                event_hashes(&decode_batch(&event_batch(flavor, form, &b), &config()).expect("b"));
            if agrees(flavor, form) {
                assert_eq!(
                    got_a, request_a,
                    "{flavor} × {form:?}: same image, same hashes"
                );
                assert_eq!(got_b, request_b, "{flavor} × {form:?}: image b");
            } else {
                assert_ne!(
                    got_a, request_a,
                    "{flavor} × {form:?}: no identity, no match"
                );
            }
            // The text block before the image is shared; from the image on,
            // another image never shares a block (local or chained).
            assert_eq!(got_a[0], got_b[0], "{flavor} × {form:?}: text block");
            assert_ne!(
                got_a[1..],
                request_b[1..],
                "{flavor} × {form:?}: other image"
            );
            if agrees(flavor, form) {
                let (sa, sb) = (sequence_hashes(&got_a), sequence_hashes(&got_b));
                assert!(
                    sa[1..].iter().zip(&sb[1..]).all(|(x, y)| x != y),
                    "{flavor} × {form:?}"
                );
            }
            rows += 1;
        }
    }
    assert_eq!(rows, 18);
}

#[test]
fn an_identifier_that_is_not_a_digest_still_keeps_images_apart() {
    // vLLM publishes a client's uuid as the identifier; it maps through XXH3.
    let named = |id: &str| ImageIdentity {
        hash: kvroute_core::hash::mm_hash_from_identifier(id),
        identifier: id.to_owned(),
    };
    let (a, b) = (named("img-cat"), named("img-dog"));
    let hashes = |i: &ImageIdentity| {
        event_hashes(
            &decode_batch(
                &event_batch(WorkerFlavor::Vllm, Form::VllmPairs, i),
                &config(),
            )
            .expect("batch"),
        )
    };
    assert_eq!(hashes(&a), request_hashes(WorkerFlavor::Vllm, &a));
    assert_ne!(hashes(&a)[1..], hashes(&b)[1..]);
}

#[test]
fn a_malformed_image_key_costs_only_its_event() {
    let a = ImageIdentity::from_hash(0xfeed);
    let good_event = event_bytes(WorkerFlavor::Vllm, Form::VllmPairs, &a);
    // The same event with one mm_key whose hash is a number, and one whose
    // block_mm_infos entry is a string.
    let bad_events: [Writer<'_>; 2] = [
        &|o| {
            mp::str(o, "mm_keys");
            mp::array(o, 1);
            mp::array(o, 1);
            mp::map(o, 1);
            mp::str(o, "hash");
            mp::uint(o, 7);
        },
        &|o| {
            mp::str(o, "block_mm_infos");
            mp::array(o, 1);
            mp::str(o, "not a map");
        },
    ];
    for bad_key in bad_events {
        let mut bad = Vec::new();
        mp::map(&mut bad, 6);
        mp::str(&mut bad, "type");
        mp::str(&mut bad, "BlockStored");
        mp::str(&mut bad, "block_hashes");
        mp::uints(&mut bad, &[21]);
        mp::str(&mut bad, "parent_block_hash");
        mp::nil(&mut bad);
        mp::str(&mut bad, "token_ids");
        mp::uints(&mut bad, &[1, 2, 3, 4, 5, 6, 7, 8]);
        mp::str(&mut bad, "block_size");
        mp::uint(&mut bad, BS as u64);
        bad_key(&mut bad);
        let batch = batch_of(&[&good_event, &bad, &good_event]);
        let decoded = StreamDecoder::new(config())
            .decode(&batch)
            .expect("envelope");
        assert_eq!(decoded.events.len(), 3);
        assert!(decoded.events[0].outcome.is_ok());
        assert_eq!(
            decoded.events[1].outcome.as_ref().err().map(|s| s.reason),
            Some(SkipReason::InvalidField)
        );
        assert!(decoded.events[2].outcome.is_ok(), "{:?}", decoded.events[2]);
        assert_eq!(decoded.lost_events, 0);
    }
}

#[test]
fn sglang_namespace_strings_in_extra_keys_are_not_salts() {
    // SGLang's aligned extra_keys carry the namespace (LoRA and/or salt) on
    // the first block; its lora_name / cache_salt fields already say so.
    let entries = |lora: bool| {
        let mut e = Vec::new();
        mp::map(&mut e, 7);
        mp::str(&mut e, "type");
        mp::str(&mut e, "BlockStored");
        mp::str(&mut e, "block_hashes");
        mp::uints(&mut e, &[31]);
        mp::str(&mut e, "parent_block_hash");
        mp::nil(&mut e);
        mp::str(&mut e, "token_ids");
        mp::uints(&mut e, &[1, 2, 3, 4, 5, 6, 7, 8]);
        mp::str(&mut e, "block_size");
        mp::uint(&mut e, BS as u64);
        if lora {
            mp::str(&mut e, "lora_name");
            mp::str(&mut e, "sql-adapter");
        } else {
            mp::str(&mut e, "cache_salt");
            mp::str(&mut e, "tenant-0");
        }
        mp::str(&mut e, "extra_keys");
        mp::array(&mut e, 1);
        mp::array(&mut e, 1);
        mp::str(&mut e, "prefix-8ea412a7871a31b37fb8f23814bf2fb3");
        e
    };
    for lora in [true, false] {
        let decoded = decode_batch(&batch_of(&[&entries(lora)]), &config()).expect("envelope");
        let Ok(KvEvent::Stored(s)) = &decoded.events[0].outcome else {
            panic!("{:?}", decoded.events[0]);
        };
        let expected_salt = (!lora).then_some("tenant-0");
        assert_eq!(s.cache_salt.as_deref(), expected_salt, "lora {lora}");
    }
}

/// vLLM names a `data:` URL image by BLAKE3 over its encoded bytes and the
/// engine's model folder: the identifiers its own hasher printed
/// (`scripts/vllm-image-hash.py`, run in vLLM 0.32's environment) are the
/// request side's.
#[test]
fn a_data_url_image_is_named_as_vllms_own_hasher_names_it() {
    let path = super::common::fixtures_dir().join("vllm_0.32_image_hash.json");
    let text = std::fs::read_to_string(&path).expect("the vector file");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let vectors = doc["vectors"].as_array().expect("vectors");
    assert!(vectors.len() >= 2);
    for v in vectors {
        let (png, model, want) = (
            v["png_base64"].as_str().expect("png"),
            v["model_id"].as_str().expect("model"),
            v["identifier"].as_str().expect("identifier"),
        );
        let url = format!("data:image/png;base64,{png}");
        let identity = ImageIdentity::from_url_for(&url, Some(model)).expect("a valid URL");
        assert_eq!(identity.identifier, want, "model {model}");
        assert_eq!(
            identity.vllm_mm_hash(),
            u64::from_str_radix(&want[..16], 16).expect("hex")
        );
    }
}
