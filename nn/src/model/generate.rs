//! Text generation with a KV cache: the prompt runs once through the model (prefill),
//! then each new token alone, every attention layer attending to the keys and values it
//! cached ([`ParallelAttention::forward_cached`](crate::ParallelAttention::forward_cached)).
//! Heads split over `Tp` as in training, so each rank caches only its own KV heads; the
//! logits are gathered whole on every rank, and every rank draws the same token (the same
//! logits and the same seeded generator).
//!
//! Sampling follows transformers' order: temperature, then top-k, then top-p (the
//! smallest set of most likely tokens whose probabilities sum to at least `p`), then a
//! draw; temperature 0 is greedy (the first of the largest logits).

use crate::data::DataMode;
use crate::model::gpt::Gpt;
use crate::seq::{Ids, SeqMode};
use dtensor_core::{DTensor, Error, Result, Tape};
use dtensor_kernels::Tensor;

/// What each attention layer has cached: its keys and values so far.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<Tensor>>,
    len: usize,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes this rank holds in the cache.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(Tensor::size_in_bytes)
            .sum()
    }
}

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits before the softmax; 0 is greedy.
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the most likely tokens until their probabilities sum to at least `p` (1: all).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// `Err` unless the temperature is finite and ≥ 0, `top_k` ≥ 1 and `0 < top_p ≤ 1`.
    pub fn check(&self) -> Result<()> {
        let ok = self.temperature.is_finite()
            && self.temperature >= 0.0
            && self.top_k != Some(0)
            && self.top_p > 0.0
            && self.top_p <= 1.0;
        match ok {
            true => Ok(()),
            false => Err(Error::InvalidUse {
                op: "Sampling",
                detail: format!(
                    "temperature {} (finite, ≥ 0), top-k {:?} (≥ 1), top-p {} (in (0, 1])",
                    self.temperature, self.top_k, self.top_p
                ),
            }),
        }
    }
}

/// SplitMix64: a small, fast generator whose stream is the same on every rank.
struct SplitMix(u64);

impl SplitMix {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The token `s` picks from `logits` (one per vocabulary entry).
fn choose(logits: &[f64], s: &Sampling, rng: &mut SplitMix) -> usize {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv {
                    (i, v)
                } else {
                    (bi, bv)
                }
            })
            .0
    };
    if s.temperature == 0.0 {
        return argmax();
    }
    // Most likely first; ties by index, so every rank sorts alike.
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if let Some(k) = s.top_k {
        order.truncate(k.max(1));
    }
    let top = logits[order[0]] / s.temperature;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| (logits[i] / s.temperature - top).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut kept = 0;
    let mut mass = 0.0;
    for w in &weights {
        kept += 1;
        mass += w / total;
        if mass >= s.top_p {
            break;
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let mut u = rng.next_f64() * kept_total;
    for (i, w) in weights[..kept].iter().enumerate() {
        if u < *w {
            return order[i];
        }
        u -= w;
    }
    order[kept - 1]
}

impl<M: SeqMode, D: DataMode> Gpt<M, D> {
    /// Collective over the mesh: runs `ids` (one sample's next tokens, at positions
    /// `cache.len()..`) through the model, extending `cache`, and returns the logits of the
    /// last of them, whole (`[vocab]`), on every rank. The mesh's data and context axes
    /// must have size 1; no sequence parallelism.
    pub fn decode(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f64>> {
        const OP: &str = "Gpt::decode";
        if ids.is_empty() {
            return Err(Error::InvalidUse {
                op: OP,
                detail: "no tokens to decode".into(),
            });
        }
        let mesh = self.embedding.weight.value().device_mesh().clone();
        let n = ids.len();
        let t = Tensor::from_vec(ids.iter().map(|&i| i64::from(i)).collect(), &[n])?;
        let tape = Tape::new();
        let ids = tape.constant(DTensor::<Ids>::from_global(&t, &mesh)?);
        let mut x = self.embedding.forward::<M>(&tape, &ids)?;
        cache.layers.resize(self.blocks.len(), None);
        for (b, c) in self.blocks.iter().zip(&mut cache.layers) {
            x = b.forward_cached(&tape, &x, c, cache.len)?;
        }
        cache.len += n;
        let logits = self.logits(&tape, &x)?.value().full_tensor()?.to_host()?;
        let vocab = self.config.vocab;
        let all = logits.to_f64_vec();
        Ok(all[all.len() - vocab..].to_vec())
    }

    /// Collective over the mesh: `prompt` followed by up to `max_new` tokens drawn as
    /// `sampling` says, stopping early after any of `stop` (an end-of-sequence id). The
    /// prompt runs once; each new token reads the KV cache. Every rank returns the same
    /// tokens (the new ones only).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        sampling.check()?;
        let mut cache = KvCache::new();
        let mut rng = SplitMix(sampling.seed);
        let mut out = Vec::with_capacity(max_new);
        let mut next = prompt.to_vec();
        while out.len() < max_new {
            let logits = self.decode(&next, &mut cache)?;
            let token = choose(&logits, sampling, &mut rng) as u32;
            out.push(token);
            if stop.contains(&token) {
                break;
            }
            next = vec![token];
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest() {
        let mut rng = SplitMix(1);
        assert_eq!(
            choose(&[0.1, 3.0, 3.0, -1.0], &Sampling::greedy(), &mut rng),
            1
        );
    }

    #[test]
    fn top_k_one_and_a_tiny_top_p_are_greedy_whatever_the_draw() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        for seed in 0..20 {
            let mut rng = SplitMix(seed);
            let k1 = Sampling {
                temperature: 1.0,
                top_k: Some(1),
                top_p: 1.0,
                seed,
            };
            assert_eq!(choose(&logits, &k1, &mut rng), 1);
            let p = Sampling {
                top_k: None,
                top_p: 1e-9,
                ..k1
            };
            assert_eq!(choose(&logits, &p, &mut rng), 1);
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Two tokens with probabilities e/(1+e) and 1/(1+e) at temperature 1.
        let logits = [1.0, 0.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            seed: 7,
        };
        let mut rng = SplitMix(7);
        let n = 20_000;
        let zeros = (0..n)
            .filter(|_| choose(&logits, &s, &mut rng) == 0)
            .count();
        let want = 1f64.exp() / (1.0 + 1f64.exp());
        assert!((zeros as f64 / n as f64 - want).abs() < 0.01, "{zeros}");
        // top-k 2 of 3 never draws the third.
        let s3 = Sampling {
            top_k: Some(2),
            ..s
        };
        assert!((0..1000).all(|_| choose(&[1.0, 0.5, 0.9], &s3, &mut rng) != 1));
    }

    #[test]
    fn bad_settings_are_refused() {
        for s in [
            Sampling {
                temperature: -1.0,
                ..Sampling::greedy()
            },
            Sampling {
                temperature: f64::NAN,
                ..Sampling::greedy()
            },
            Sampling {
                top_k: Some(0),
                ..Sampling::greedy()
            },
            Sampling {
                top_p: 0.0,
                ..Sampling::greedy()
            },
            Sampling {
                top_p: 1.5,
                ..Sampling::greedy()
            },
        ] {
            assert!(s.check().is_err(), "{s:?}");
        }
    }
}
