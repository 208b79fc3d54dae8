//! What `vkd explain` can fail with; each variant is a different exit code
//! (`src/main.rs`).

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    /// The API server or vkd refused the user.
    #[error("refused: {0}")]
    Refused(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("kubernetes API: {0}")]
    Api(String),
    #[error("{0}")]
    Usage(String),
}

impl ExplainError {
    pub(crate) fn of(e: kube::Error, what: &str) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 403 => Self::Refused(format!("{what}: {}", s.message)),
            kube::Error::Api(s) if s.code == 404 => {
                Self::NotFound(format!("{what}: {}", s.message))
            }
            other => Self::Api(format!("{what}: {other}")),
        }
    }
}
