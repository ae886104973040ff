//! Where the relay's backends and its side application listen ([`Address`]: TCP or a Unix
//! socket) and the stream to one ([`Stream`]: connected with a time limit, `TCP_NODELAY`),
//! which hyper's client connections run on.
//!
//! O(1) per connection besides the bytes moved; each stream is owned by one connection.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
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
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, data),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
