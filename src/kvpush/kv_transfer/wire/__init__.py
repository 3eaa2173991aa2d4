"""Between instances: side-channel messages, sockets, CURVE and message authentication."""
