//! The handshake between the two launchers of a new container (see `launch`):
//! nothing of the Pod runs before vkd holds the container's namespaces.

/// The two pipes between the first launcher of a new container and its
/// second: the second says when the namespaces are complete, the first holds
/// them and says go on (or not). Nothing of the Pod runs until then.
pub(super) struct Sync {
    ready: std::os::fd::OwnedFd,
    go: std::os::fd::OwnedFd,
    /// The second launcher's ends, closed here once it has them.
    pub(super) child_ends: Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>,
}

impl Sync {
    pub(super) fn new() -> Result<Self, String> {
        use rustix::io::{FdFlags, fcntl_setfd};
        let e = |e: rustix::io::Errno| format!("a pipe to the container's first process: {e}");
        // Inherited by the second launcher: without close-on-exec.
        let (ready, ready_w) = rustix::pipe::pipe().map_err(e)?;
        let (go_r, go) = rustix::pipe::pipe().map_err(e)?;
        fcntl_setfd(&ready, FdFlags::CLOEXEC).map_err(e)?;
        fcntl_setfd(&go, FdFlags::CLOEXEC).map_err(e)?;
        Ok(Self {
            ready,
            go,
            child_ends: Some((ready_w, go_r)),
        })
    }

    pub(super) fn child_arg(&self) -> String {
        use std::os::fd::AsRawFd;
        match &self.child_ends {
            Some((w, r)) => format!("{}:{}", w.as_raw_fd(), r.as_raw_fd()),
            None => String::new(),
        }
    }

    /// Waits until the second launcher says its namespaces are complete.
    pub(super) fn await_ready(&self) -> Result<(), String> {
        let mut byte = [0u8];
        match rustix::io::read(&self.ready, &mut byte) {
            Ok(1) => Ok(()),
            Ok(_) => {
                Err("the container's first process ended before its namespaces were made".into())
            }
            Err(e) => Err(format!("waiting for the container's namespaces: {e}")),
        }
    }

    /// Lets the second launcher go on (`ok`) or end.
    pub(super) fn release(self, ok: bool) -> Result<(), String> {
        let byte = if ok { b"1" } else { b"0" };
        rustix::io::write(&self.go, byte)
            .map(|_| ())
            .map_err(|e| format!("letting the container start: {e}"))
    }

    /// In the second launcher: says the namespaces are complete and waits
    /// for the first to hold them.
    #[allow(unsafe_code)]
    pub(super) fn child_ready((write, read): (i32, i32)) -> Result<(), String> {
        use std::os::fd::FromRawFd;
        if write < 3 || read < 3 || write == read {
            return Err("bad --sync descriptors".into());
        }
        // SAFETY: the first launcher passed these two descriptors, open and
        // owned by nothing else in this process; each is closed once here.
        let (write, read) = unsafe {
            (
                std::os::fd::OwnedFd::from_raw_fd(write),
                std::os::fd::OwnedFd::from_raw_fd(read),
            )
        };
        rustix::io::write(&write, b"1").map_err(|e| format!("telling the launcher: {e}"))?;
        drop(write);
        let mut byte = [0u8];
        match rustix::io::read(&read, &mut byte) {
            Ok(1) if byte == *b"1" => Ok(()),
            _ => Err("the launcher could not hold the container's namespaces".into()),
        }
    }
}
