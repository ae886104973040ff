//! Sockets of the relay: one stream type for TCP and Unix-socket peers, connecting with a
//! time limit, and telling whether an idle connection was closed by its peer.
//!
//! O(1) per call besides the bytes moved; each stream is owned by one task.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Where a backend (or the side application) listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    /// A TCP host name or address and port.
    Tcp(String, u16),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(host, port) => write!(f, "{host}:{port}"),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A connected stream socket.
#[derive(Debug)]
pub enum Stream {
    /// TCP, with `TCP_NODELAY` set.
    Tcp(TcpStream),
    /// A Unix stream socket.
    Unix(UnixStream),
}

impl Stream {
    /// Connect to `address`, giving up after `limit`.
    pub async fn connect(address: &Address, limit: Duration) -> io::Result<Stream> {
        let connect = async {
            match address {
                Address::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
                Address::Tcp(host, port) => {
                    let s = TcpStream::connect((host.as_str(), *port)).await?;
                    s.set_nodelay(true)?;
                    Ok(Stream::Tcp(s))
                }
            }
        };
        tokio::time::timeout(limit, connect)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))
    }

    /// Read what is there (at least one byte, or 0 at the end) into `buf`'s spare room.
    pub async fn read_buf(&mut self, buf: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_buf(buf).await,
            Stream::Unix(s) => s.read_buf(buf).await,
        }
    }

    /// Write all of `data`.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(data).await,
            Stream::Unix(s) => s.write_all(data).await,
        }
    }

    /// An idle connection with something to read has been closed (or sent junk): unusable.
    pub fn closed_by_peer(&self) -> bool {
        let mut byte = [0u8; 1];
        let got = match self {
            Stream::Tcp(s) => s.try_read(&mut byte),
            Stream::Unix(s) => s.try_read(&mut byte),
        };
        !matches!(got, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}
