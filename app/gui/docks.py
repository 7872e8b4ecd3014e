"""The window's panels as dock widgets (as friture does): each panel can be moved, floated,
tabbed or closed, the View menu brings it back, and the layout and the window's geometry are
remembered; a saved geometry is fitted to the screen the window opens on, and without one the
window fills the screen's available area (up to 1920 x 1200)."""
from __future__ import annotations

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QDockWidget, QMainWindow, QScrollArea, QWidget

LARGEST_DEFAULT = (1920, 1200)


def dock(window: QMainWindow, title: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
    """``widget`` in a dock titled ``title`` (its objectName keys the saved layout)."""
    d = QDockWidget(title, window)
    d.setObjectName(title.lower().replace(" ", "_"))
    d.setWidget(widget)
    window.addDockWidget(area, d)
    return d


def scrolling(widget: QWidget) -> QScrollArea:
    """``widget`` in a vertical scroll area: tall controls fit a short screen."""
    area = QScrollArea()
    area.setWidget(widget)
    area.setWidgetResizable(True)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
    area.setMinimumWidth(widget.sizeHint().width() + 20)
    return area


def fitted(wanted: QRect, screen: QRect) -> QRect:
    """``wanted`` shrunk to fit ``screen`` (available area) and moved inside it."""
    w, h = min(wanted.width(), screen.width()), min(wanted.height(), screen.height())
    x = min(max(wanted.x(), screen.x()), screen.right() + 1 - w)
    y = min(max(wanted.y(), screen.y()), screen.bottom() + 1 - h)
    return QRect(x, y, w, h)


def available_area(window: QMainWindow) -> QRect:
    screen = window.screen() or QGuiApplication.primaryScreen()
    return screen.availableGeometry()


def restore(window: QMainWindow, geometry, state) -> None:
    """The saved geometry and dock layout (bytes, or None), else the screen's available area;
    fitted to it. Saved bytes Qt cannot read leave the default."""
    screen = available_area(window)
    if geometry is None or not window.restoreGeometry(geometry):
        window.setGeometry(screen.x(), screen.y(), min(screen.width(), LARGEST_DEFAULT[0]),
                           min(screen.height(), LARGEST_DEFAULT[1]))
    if state is not None:
        window.restoreState(state)
    frame = window.frameGeometry()
    margin_w, margin_h = frame.width() - window.width(), frame.height() - window.height()
    inner = fitted(QRect(window.x(), window.y(), window.width() + margin_w, window.height() + margin_h), screen)
    window.setGeometry(inner.x(), inner.y(), inner.width() - margin_w, inner.height() - margin_h)


def save(window: QMainWindow, settings) -> None:
    settings.setValue("window/geometry", window.saveGeometry())
    settings.setValue("window/state", window.saveState())
