//! Times and the phase, as a record keeps them: small and `Copy`.

use std::time::SystemTime;

/// A wall-clock time to the millisecond in 8 bytes (`Option<Stamp>` too), half
/// a `SystemTime`: a record keeps a dozen of them for each of thousands of Pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(std::num::NonZeroU64);

impl Stamp {
    pub fn now() -> Self {
        SystemTime::now().into()
    }

    pub fn time(self) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(self.0.get())
    }
}

impl From<SystemTime> for Stamp {
    fn from(t: SystemTime) -> Self {
        let ms = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self(std::num::NonZeroU64::new(ms).unwrap_or(std::num::NonZeroU64::MIN))
    }
}

/// A time as the API writes one (RFC 3339, to the second, in UTC).
pub fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|ts| ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

/// When each step of a Pod's start happened.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub bound: Option<Stamp>,
    pub observed: Option<Stamp>,
    pub admitted: Option<Stamp>,
    pub accepted: Option<Stamp>,
    pub started: Option<Stamp>,
    pub ready: Option<Stamp>,
}

impl Timeline {
    /// The steps after the binding, in order, with when each happened.
    pub fn stages(&self) -> [(&'static str, Option<Stamp>); 5] {
        [
            ("observed", self.observed),
            ("admitted", self.admitted),
            ("accepted", self.accepted),
            ("started", self.started),
            ("ready", self.ready),
        ]
    }

    /// `bound=<time> observed=+12ms admitted=+13ms ...`, offsets from the binding.
    pub fn render(&self) -> String {
        let base = self.bound.or(self.observed).map(Stamp::time);
        let mut out = Vec::new();
        if let Some(b) = self.bound {
            out.push(format!("bound={}", rfc3339(b.time())));
        }
        for (name, t) in self.stages() {
            if let (Some(t), Some(base)) = (t.map(Stamp::time), base) {
                let ms = t.duration_since(base).map_or(0, |d| d.as_millis());
                out.push(format!("{name}=+{ms}ms"));
            }
        }
        out.join(" ")
    }
}

/// A Pod's phase, as the API server holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// No phase written yet.
    #[default]
    None,
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl Phase {
    pub fn parse(s: &str) -> Self {
        match s {
            "" => Self::None,
            "Pending" => Self::Pending,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            _ => Self::Unknown,
        }
    }

    /// The name for metrics; a Pod with no phase yet counts as Pending.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None | Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Unknown => "Unknown",
        }
    }
}
