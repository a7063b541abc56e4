//! How long one scheduler step takes: Dynamo's published polynomial by default.
//!
//! * prefill: `prefill_ms(T) = 4.209989e-7·T² + 1.518344e-2·T + 16.50142`,
//!   T = uncached prompt tokens computed in the step;
//! * decode: `decode_ms(u) = −25.74·u² + 54.01·u + 5.74`, floor 1 ms,
//!   u = active KV tokens ÷ KV capacity (0..1);
//! * a step that does both takes the longer of the two (decode tokens ride along
//!   in a chunked-prefill step);
//! * `speedup` divides every result.
//!
//! Worked example: a 1,000-token uncached prompt alone takes
//! `0.4209989 + 15.18344 + 16.50142 = 32.1058589 ms`; each decode step at 10 %
//! KV usage takes `−0.2574 + 5.401 + 5.74 = 10.884 ms`.

use std::time::Duration;

/// A quadratic `a·x² + b·x + c`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quadratic {
    /// Coefficient of x².
    pub a: f64,
    /// Coefficient of x.
    pub b: f64,
    /// Constant term.
    pub c: f64,
}

impl Quadratic {
    /// The value at `x`.
    pub fn at(&self, x: f64) -> f64 {
        (self.a * x + self.b) * x + self.c
    }
}

/// The step-time model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Milliseconds of a step computing T uncached prompt tokens.
    pub prefill_ms: Quadratic,
    /// Milliseconds of a decode step at KV usage u.
    pub decode_ms: Quadratic,
    /// Lower bound of a decode step, in milliseconds.
    pub decode_floor_ms: f64,
    /// Divides every time (`--speedup`).
    pub speedup: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill_ms: Quadratic {
                a: 4.209989e-7,
                b: 1.518344e-2,
                c: 16.50142,
            },
            decode_ms: Quadratic {
                a: -25.74,
                b: 54.01,
                c: 5.74,
            },
            decode_floor_ms: 1.0,
            speedup: 1.0,
        }
    }
}

impl TimingModel {
    /// Milliseconds (before speedup) of a step with `prefill_tokens` uncached
    /// prompt tokens, whether it also decodes, and the KV usage fraction.
    pub fn step_ms(&self, prefill_tokens: usize, decodes: bool, kv_usage: f64) -> f64 {
        let prefill = if prefill_tokens > 0 {
            self.prefill_ms.at(prefill_tokens as f64)
        } else {
            0.0
        };
        let decode = if decodes {
            self.decode_ms
                .at(kv_usage.clamp(0.0, 1.0))
                .max(self.decode_floor_ms)
        } else {
            0.0
        };
        prefill.max(decode)
    }

    /// The simulated duration of such a step, divided by the speedup.
    pub fn step_duration(&self, prefill_tokens: usize, decodes: bool, kv_usage: f64) -> Duration {
        let ms = self.step_ms(prefill_tokens, decodes, kv_usage) / self.speedup;
        Duration::from_secs_f64((ms / 1000.0).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn worked_examples_from_the_module_doc() {
        let t = TimingModel::default();
        assert!(close(t.step_ms(1000, false, 0.0), 32.1058589));
        assert!(close(t.step_ms(0, true, 0.1), 10.8836));
        assert!(close(t.step_ms(1, false, 0.0), 16.5166038609989));
    }

    #[test]
    fn decode_has_a_floor_and_mixed_steps_take_the_longer_part() {
        let t = TimingModel {
            decode_ms: Quadratic {
                a: 0.0,
                b: 0.0,
                c: -5.0,
            },
            ..TimingModel::default()
        };
        assert!(close(t.step_ms(0, true, 0.5), 1.0));
        let t = TimingModel::default();
        assert!(close(t.step_ms(10, true, 0.01), t.step_ms(10, false, 0.0)));
        assert!(close(t.step_ms(10, true, 0.5), t.step_ms(0, true, 0.5)));
        assert_eq!(t.step_ms(0, false, 0.0), 0.0);
    }

    #[test]
    fn speedup_divides_durations() {
        let t = TimingModel {
            speedup: 10.0,
            ..TimingModel::default()
        };
        let d = t.step_duration(1000, false, 0.0);
        assert!((d.as_secs_f64() - 0.00321058589).abs() < 1e-9);
    }
}
