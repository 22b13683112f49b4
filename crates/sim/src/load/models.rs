//! A workload's model names: one, or several that its requests are spread over (the LoRA
//! adapters of a base model, each served as a model of its own), in turn or at random. A
//! request's model is chosen by its place in the sending order (a session's by the session's
//! number), so every run with the same seed sends the same names in the same order.

use super::{text, Workload};

/// How a workload's requests are spread over its models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModelSpread {
    /// In turn, in the order requests are sent: every model gets the same share, give or take one.
    #[default]
    Even,
    /// Each request draws its model (seeded by the workload's seed): even on average only.
    Random,
}

/// Model names a workload spreads its requests over at most.
pub const MAX_MODELS: usize = 1024;

/// Keeps the draws of [`ModelSpread::Random`] apart from the workload's other seeded choices.
const MODEL_SALT: u64 = 0x6d6f_6465_6c73;

/// What is wrong with a list of model names to spread requests over, if anything.
pub fn check_models(models: &[String]) -> Result<(), String> {
    if models.len() > MAX_MODELS {
        return Err(format!(
            "{} models: a workload spreads its requests over at most {MAX_MODELS}",
            models.len()
        ));
    }
    if let Some(m) = models.iter().find(|m| m.is_empty()) {
        return Err(format!("model names must not be empty, got {m:?}"));
    }
    Ok(())
}

impl Workload {
    /// The model request `i` of the sending order (or session `i`) names: `model`, or with
    /// `models` one of them as `model_spread` says.
    pub fn model_of(&self, i: usize) -> &str {
        let n = self.models.len() as u64;
        let k = match self.model_spread {
            _ if n == 0 => return &self.model,
            ModelSpread::Even => i as u64 % n,
            ModelSpread::Random => text::mix(self.seed ^ MODEL_SALT, i as u64) % n,
        };
        &self.models[k as usize]
    }

    /// What is wrong with the workload's models, if anything.
    pub(super) fn check_models(&self) -> Result<(), String> {
        check_models(&self.models)?;
        if self.grpc.is_some() && !self.models.is_empty() {
            return Err("gRPC Generate names no model: spreading over models is HTTP only".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spread(models: &[&str], how: ModelSpread) -> Vec<String> {
        let mut w = Workload::new("http://x");
        w.models = models.iter().map(|m| m.to_string()).collect();
        w.model_spread = how;
        (0..300).map(|i| w.model_of(i).to_string()).collect()
    }

    #[test]
    fn requests_are_spread_in_turn_or_at_random_and_one_model_is_the_default() {
        assert!(spread(&[], ModelSpread::Even)
            .iter()
            .all(|m| m == "tiny-llama"));
        let even = spread(&["a", "b", "c"], ModelSpread::Even);
        assert_eq!(&even[..4], ["a", "b", "c", "a"]);
        let random = spread(&["a", "b", "c"], ModelSpread::Random);
        assert_eq!(
            random,
            spread(&["a", "b", "c"], ModelSpread::Random),
            "seeded"
        );
        assert_ne!(random, even);
        for m in ["a", "b", "c"] {
            let n = random.iter().filter(|x| *x == m).count();
            assert!((60..=140).contains(&n), "{m}: {n} of 300");
        }
        assert!(check_models(&["".into()]).is_err());
        assert!(check_models(&vec!["a".to_string(); MAX_MODELS + 1]).is_err());
    }
}
