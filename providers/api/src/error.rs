//! What a provider call can fail with.

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// No instance for that Pod UID.
    #[error("no instance for pod {uid}")]
    NotFound { uid: String },
    /// The provider does not offer this capability.
    #[error("provider {provider} does not support {capability}")]
    Unsupported {
        provider: String,
        capability: &'static str,
    },
    /// The call's epoch is older than one the backend has seen for the node.
    #[error("fenced: node {node} is at epoch {current}, call carried epoch {got}")]
    Fenced {
        node: String,
        current: u64,
        got: u64,
    },
    /// The Pod cannot run on this backend as specified; the Pod should fail.
    #[error("{reason}: {message}")]
    Invalid { reason: String, message: String },
    /// The backend has no room for it.
    #[error("rejected: {message}")]
    Rejected { message: String },
    /// Try again later.
    #[error("transient backend error: {message}")]
    Transient { message: String },
}

impl ProviderError {
    pub fn transient(message: impl Into<String>) -> Self {
        Self::Transient {
            message: message.into(),
        }
    }

    pub fn invalid(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// A short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotFound { .. } => "not_found",
            Self::Unsupported { .. } => "unsupported",
            Self::Fenced { .. } => "fenced",
            Self::Invalid { .. } => "invalid",
            Self::Rejected { .. } => "rejected",
            Self::Transient { .. } => "transient",
        }
    }
}

pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// The reason a provider gives (in [`Admission::Rejected`] or
/// [`ProviderError::Invalid`]) when it cannot obtain or run a container's
/// image. vkd treats it as the kubelet treats a failed image pull: the Pod
/// stays Pending, its containers wait (`ErrImagePull`, then
/// `ImagePullBackOff`), and the start is tried again with a back-off, so a
/// Pod whose image is then fixed runs.
pub const IMAGE_NOT_RUNNABLE: &str = "ImageNotRunnable";

/// The reason a provider gives ([`ProviderError::Invalid`]) when it could
/// not set up what a Pod runs in (its network, say) and has given back what
/// it had set up: the kubelet's `FailedCreatePodSandBox`. vkd keeps the Pod
/// Pending (`ContainerCreating`), says why in a Warning Event, and tries the
/// start again with a back-off, as the kubelet retries a sandbox.
pub const SANDBOX_NOT_CREATED: &str = "FailedCreatePodSandBox";
