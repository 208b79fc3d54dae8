//! The protocol's Unix sockets: who may reach them and who is at the other
//! end. A plugin's socket is made 0600 (its user's alone) in a directory no
//! one else can write, and both sides ask the kernel who the other is
//! (SO_PEERCRED): only root, the side's own user, or a uid the operator
//! named (`unix:///x.sock?peer-uid=N`, on vkd's side) is spoken to. Whoever
//! reaches a plugin can run Pods through it and read their Secrets.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Tells apart two binds of one process at once.
static BINDS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error(
        "refusing to listen on {socket}: its directory {dir} {why}; put the socket in a directory only the plugin's user (or root) can write, such as /run/vkd made 0700"
    )]
    UnsafeDirectory {
        socket: String,
        dir: PathBuf,
        why: String,
    },
    #[error(
        "refusing the provider plugin at {endpoint}: the process listening there runs as uid {uid}, and only {allowed} may serve it; if uid {uid} is the plugin's own account, name it in the endpoint: unix://{}?peer-uid={uid}", .path.display()
    )]
    UnexpectedPeer {
        endpoint: String,
        path: PathBuf,
        uid: u32,
        /// Who may: root, this process's uid, the named one.
        allowed: String,
    },
    #[error("{endpoint}: {what}: {source}")]
    Io {
        endpoint: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("listening on {0}: a file that is not a socket is there; it is left as it is")]
    NotASocket(String),
}

/// This process's effective uid: the user its sockets belong to.
pub fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Whether a peer running as `peer` may be spoken to by a process running
/// as `own`: root (it can reach any socket anyway), the same user, or the
/// one uid the operator named.
pub fn peer_allowed(peer: u32, own: u32, named: Option<u32>) -> bool {
    peer == 0 || peer == own || named == Some(peer)
}

/// Why a directory of this owner and mode is no place for `own`'s socket,
/// or None. Another user who can write it could replace the socket (or put
/// one there first); a sticky directory (`/tmp`) lets no one remove or
/// rename what another made in it.
pub fn directory_unsafe(owner: u32, mode: u32, own: u32) -> Option<String> {
    if owner != own && owner != 0 {
        return Some(format!(
            "belongs to uid {owner}, not to this process's uid {own} or root"
        ));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Some(format!(
            "is writable by {} (mode {:04o}) and not sticky",
            if mode & 0o002 != 0 {
                "everyone"
            } else {
                "its group"
            },
            mode & 0o7777
        ));
    }
    None
}

/// A listener at `path`, the socket 0600 and this process's, in a
/// directory only it (or root) can write; a socket an earlier run left
/// there is replaced, any other file is never touched.
///
/// The socket is bound in a fresh 0700 directory beside `path`, made 0600
/// there, and renamed onto `path`: it is never reachable with looser
/// permissions, not even for an instant. The umask would be the other way,
/// but it belongs to the whole process, and the providers' own threads make
/// files at the same time.
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, SocketError> {
    let socket = format!("unix://{}", path.display());
    let io = |what: &'static str| {
        let endpoint = socket.clone();
        move |source| SocketError::Io {
            endpoint,
            what,
            source,
        }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("/"),
    };
    let meta = std::fs::metadata(dir).map_err(io("its directory"))?;
    if let Some(why) = directory_unsafe(meta.uid(), meta.mode(), own_uid()) {
        return Err(SocketError::UnsafeDirectory {
            socket,
            dir: dir.to_owned(),
            why,
        });
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {}
        Ok(_) => return Err(SocketError::NotASocket(socket)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("the path")(e)),
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staging = dir.join(format!(
        ".{name}.binding-{}-{}",
        std::process::id(),
        BINDS.fetch_add(1, Ordering::Relaxed)
    ));
    // Mode 0700 less the umask: never more than the owner's.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .map_err(io("a private directory to bind in"))?;
    let staged = staging.join("s");
    let bound = place(&staged, path, &socket);
    if bound.is_err() {
        let _ = std::fs::remove_file(&staged);
    }
    let _ = std::fs::remove_dir(&staging);
    bound
}

/// Binds at `staged` (in a directory only this process's user can enter),
/// makes the socket 0600 and renames it onto `path`: atomic, so a client
/// sees the old socket or the new one, never none and never one with other
/// permissions.
fn place(
    staged: &Path,
    path: &Path,
    socket: &str,
) -> Result<tokio::net::UnixListener, SocketError> {
    let io = |what: &'static str| {
        move |source| SocketError::Io {
            endpoint: socket.to_owned(),
            what,
            source,
        }
    };
    let listener = tokio::net::UnixListener::bind(staged).map_err(io("binding"))?;
    std::fs::set_permissions(staged, std::fs::Permissions::from_mode(0o600))
        .map_err(io("making the socket 0600"))?;
    std::fs::rename(staged, path).map_err(io("moving the socket into place"))?;
    Ok(listener)
}

/// A connection to the plugin at `path`, refused unless the process that
/// listens there is root, this process's user, or `named`.
pub async fn dial(
    path: &Path,
    named: Option<u32>,
    endpoint: &str,
) -> Result<tokio::net::UnixStream, SocketError> {
    let io = |what: &'static str| {
        move |source| SocketError::Io {
            endpoint: endpoint.to_owned(),
            what,
            source,
        }
    };
    let stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(io("connecting"))?;
    let uid = stream
        .peer_cred()
        .map_err(io("asking who listens (SO_PEERCRED)"))?
        .uid();
    let own = own_uid();
    if !peer_allowed(uid, own, named) {
        let mut allowed = vec!["root".to_owned()];
        if own != 0 {
            allowed.push(format!("this process's uid {own}"));
        }
        allowed.extend(named.map(|n| format!("the named uid {n}")));
        return Err(SocketError::UnexpectedPeer {
            endpoint: endpoint.to_owned(),
            path: path.to_owned(),
            uid,
            allowed: allowed.join(" or "),
        });
    }
    Ok(stream)
}

/// The connections of clients that are root or this process's user; any
/// other is closed at once and logged. The socket's mode already keeps
/// others out: this holds even if someone loosens it.
pub fn accept(
    listener: tokio::net::UnixListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::UnixStream>> {
    use tokio_stream::StreamExt;
    let own = own_uid();
    tokio_stream::wrappers::UnixListenerStream::new(listener).filter(move |conn| {
        let Ok(stream) = conn else { return true };
        match stream.peer_cred() {
            Ok(c) if peer_allowed(c.uid(), own, None) => true,
            Ok(c) => {
                tracing::warn!(
                    uid = c.uid(),
                    pid = ?c.pid(),
                    "refused a client of the provider protocol: not root and not this plugin's user"
                );
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "refused a client of the provider protocol: SO_PEERCRED");
                false
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_root_the_same_user_or_the_named_one_is_a_peer() {
        assert!(peer_allowed(0, 1000, None));
        assert!(peer_allowed(1000, 1000, None));
        assert!(peer_allowed(990, 0, Some(990)));
        assert!(!peer_allowed(65534, 0, None));
        assert!(!peer_allowed(65534, 1000, Some(990)));
    }

    #[test]
    fn a_directory_others_can_write_is_no_place_for_a_socket() {
        assert_eq!(directory_unsafe(0, 0o040700, 0), None);
        assert_eq!(directory_unsafe(0, 0o040755, 1000), None);
        assert_eq!(directory_unsafe(1000, 0o040700, 1000), None);
        // /tmp: no one removes or renames what another made there.
        assert_eq!(directory_unsafe(0, 0o041777, 1000), None);
        for (owner, mode, own) in [
            (0, 0o040777, 0),
            (0, 0o040775, 0),
            (1000, 0o040700, 0),
            (1000, 0o040700, 1001),
            (65534, 0o041777, 0),
        ] {
            assert!(
                directory_unsafe(owner, mode, own).is_some(),
                "{owner} {mode:o} {own}"
            );
        }
        let why = directory_unsafe(0, 0o040777, 0).unwrap_or_default();
        assert!(why.contains("everyone") && why.contains("0777"), "{why}");
    }
}
